"""One training run from start to end: open it, start the job's peers, train, finish it.

The job loop itself is groupflow/job.py; this module owns what surrounds it: the model path,
the run directory, the Prometheus endpoint, the Ray connection and the actors' lifetimes.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import ray

from groupflow.actors.futures import RayFutures
from groupflow.actors.generator import start_generator_pool
from groupflow.actors.learner import LearnerGroup
from groupflow.actors.reward import RewardPool
from groupflow.actors.transport import make_transport
from groupflow.config import Config
from groupflow.job import TrainingJob
from groupflow.metrics import MetricsWriter, ProgressReporter
from groupflow.plots import write_plots
from groupflow.prometheus import PrometheusExporter
from groupflow.reward_workers.tasks import make_task

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class RunError(RuntimeError):
    """A problem with the job's inputs, reported as one line."""


def resolve_model_path(cfg: Config) -> str:
    if cfg.model.path is None:
        from groupflow.quickstart import quickstart_model_path

        return str(
            quickstart_model_path(
                cfg.task.name, cfg.task.options, cfg.model.warm_start_steps, cfg.metrics.progress
            )
        )
    path = Path(cfg.model.path)
    if not (path / "config.json").is_file():
        raise RunError(f"model.path: {path} is not a Hugging Face model directory (no config.json)")
    return str(path)


def fresh_run_dir(run_dir: Path) -> Path:
    """An empty run directory; an earlier run of the same name is kept, renamed by its time."""
    if run_dir.exists() and any(run_dir.iterdir()):
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(run_dir.stat().st_mtime))
        kept = run_dir.with_name(f"{run_dir.name}.{stamp}")
        run_dir.rename(kept)
        log.info("kept the earlier run %s as %s", run_dir, kept)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


@dataclass
class OpenRun:
    """What a run holds open while it trains."""

    cfg: Config
    model_path: str
    run_dir: Path
    exporter: PrometheusExporter | None
    started_ray: bool  # this process started a local cluster, so it stops it
    started: float

    def close(self) -> None:
        if self.exporter is not None:
            self.exporter.close()
        if self.started_ray:
            ray.shutdown()


def _start_exporter(cfg: Config) -> PrometheusExporter | None:
    m = cfg.metrics
    if m.prometheus_port is None:
        return None
    try:
        exporter = PrometheusExporter(cfg.trainer.run_name, m.prometheus_port, m.prometheus_addr)
    except OSError as err:
        raise RunError(
            f"metrics.prometheus_port: cannot serve on "
            f"{m.prometheus_addr}:{m.prometheus_port} ({err.strerror})"
        ) from None
    log.info("Prometheus metrics on http://%s:%d/metrics", m.prometheus_addr, exporter.port)
    return exporter


def open_run(cfg: Config) -> OpenRun:
    """Check the model, make the run directory, serve metrics and connect to Ray."""
    model_path = resolve_model_path(cfg)
    run_dir = fresh_run_dir(Path(cfg.trainer.output_dir) / cfg.trainer.run_name)
    (run_dir / "config.resolved.yaml").write_text(cfg.dump_yaml())
    exporter = _start_exporter(cfg)
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address=cfg.cluster.address, num_cpus=cfg.cluster.num_cpus, log_to_driver=False)
    return OpenRun(cfg, model_path, run_dir, exporter, started_ray, time.monotonic())


def start_job(run: OpenRun) -> TrainingJob:
    """Start the engines, the reward workers and the learner ranks; on a failure, stop
    those already started."""
    cfg = run.cfg
    with ExitStack() as undo:
        generators = start_generator_pool(cfg, run.model_path)
        undo.callback(generators.shutdown)
        rewards = RewardPool(cfg)
        undo.callback(rewards.shutdown)
        learner = LearnerGroup(cfg, run.model_path)
        undo.callback(learner.shutdown)
        job = TrainingJob(
            cfg,
            make_task(cfg.task.name, cfg.task.options),
            generators=generators,
            rewards=rewards,
            learner=learner,
            transport=make_transport(cfg.rollout.weight_transport, learner, generators.engines),
            futures=RayFutures(),
            exporter=run.exporter,
        )
        undo.pop_all()
    log.info("actors up in %.1fs", time.monotonic() - run.started)
    return job


def train(run: OpenRun, job: TrainingJob) -> None:
    with (
        MetricsWriter(run.run_dir / "metrics.jsonl") as writer,
        ProgressReporter(run.cfg) as progress,
    ):
        job.train([writer, progress])


def finish_run(run: OpenRun, job: TrainingJob, warm_accuracy: float) -> dict:
    """Plots, the final evaluation, the model and summary.json; returns the summary."""
    write_plots(run.run_dir / "metrics.jsonl", run.run_dir)
    final = job.evaluate()
    log.info("held-out greedy accuracy after training: %.3f", final)
    model_dir = run.run_dir / "model"
    job.learner.save_pretrained(str(model_dir))
    for name in TOKENIZER_FILES:
        if (Path(run.model_path) / name).is_file():
            shutil.copy(Path(run.model_path) / name, model_dir / name)
    summary = {
        "steps": run.cfg.trainer.steps,
        "warm_start_accuracy": warm_accuracy,
        "final_accuracy": final,
        "policy_version": job.version,
        "wall_time_s": time.monotonic() - run.started,
        "model_dir": str(model_dir),
    }
    (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def run(cfg: Config) -> dict:
    """Run one training job; returns the summary also written to summary.json."""
    opened = open_run(cfg)
    job = None
    try:
        job = start_job(opened)
        warm = job.evaluate()
        log.info("held-out greedy accuracy before training: %.3f", warm)
        train(opened, job)
        return finish_run(opened, job, warm)
    finally:
        if job is not None:
            job.shutdown()
        opened.close()
