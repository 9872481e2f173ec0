"""The driver: one training job as a pipelined dataflow over the actors.

prompts -> generators (G samples each, streamed per chunk) -> reward pool (scores as chunks
arrive) -> advantages -> learner ranks (ZeRO-3) -> weight sync -> engines.
With trainer.max_staleness = 1 the next step's generation runs while the learner trains.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import ray
import torch

from groupflow.actors.generator import start_generators
from groupflow.actors.learner import LearnerGroup
from groupflow.actors.reward import RewardPool
from groupflow.actors.transport import make_transport
from groupflow.config import Config
from groupflow.evaluate import greedy_accuracy
from groupflow.metrics import MetricsWriter, ProgressReporter, step_metrics
from groupflow.plots import write_plots
from groupflow.prometheus import PrometheusExporter
from groupflow.records import Prompt, ScoredGroup, TrainSequence
from groupflow.learner.advantages import compute_advantages
from groupflow.reward_workers.tasks import make_task
from groupflow.rollout.engine import SamplingSettings

log = logging.getLogger(__name__)


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


@dataclass
class Rollout:
    """One step's generation in flight: chunk references and when they were launched."""

    refs: list
    started: float


class Trainer:
    def __init__(self, cfg: Config, exporter: PrometheusExporter | None = None):
        self.cfg = cfg
        self.exporter = exporter
        self.task = make_task(cfg.task.name, cfg.task.options)
        self.prompts: Iterator[Prompt] = self.task.train_prompts(cfg.trainer.seed)
        self.eval_set = self.task.eval_prompts(cfg.task.eval_size)
        s = cfg.rollout.sampling
        self.sampling = SamplingSettings(s.temperature, s.top_p, s.max_tokens)
        self.version = 0

    # ----- lifecycle ---------------------------------------------------------------------------
    def start(self, model_path: str) -> None:
        self.engines = start_generators(self.cfg, model_path)
        self.rewards = RewardPool(self.cfg)
        self.learner = LearnerGroup(self.cfg, model_path)
        self.transport = make_transport(self.cfg.rollout.weight_transport)
        self._engine_load = [0] * len(self.engines)

    # ----- generation and scoring --------------------------------------------------------------
    def _launch(self, prompts: list[Prompt]) -> Rollout:
        """Send prompts in chunks, each to the engine with the least outstanding work, so that
        finished chunks can be scored while later ones are still generating."""
        chunk = max(1, len(prompts) // (2 * len(self.engines)))
        refs = []
        for start in range(0, len(prompts), chunk):
            part = prompts[start : start + chunk]
            e = min(range(len(self.engines)), key=self._engine_load.__getitem__)
            self._engine_load[e] += len(part)
            ref = self.engines[e].sample.remote(part, self.cfg.rollout.group_size, self.sampling)
            refs.append((ref, e, len(part)))
        return Rollout(refs, time.monotonic())

    def _collect(self, rollout: Rollout) -> tuple[list[ScoredGroup], float, float]:
        """Stream chunks to the reward pool as they finish; returns groups, gen and reward waits."""
        pending = {ref: (e, n) for ref, e, n in rollout.refs}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            e, n = pending.pop(ready[0])
            self._engine_load[e] -= n
            self.rewards.submit(ray.get(ready[0]))
        gen_done = time.monotonic()
        self._export_queues()
        scored = self.rewards.drain()
        return scored, gen_done - rollout.started, time.monotonic() - gen_done

    def _export_queues(self) -> None:
        if self.exporter is not None:
            self.exporter.set_queue_depth("generation", sum(self._engine_load))
            self.exporter.set_queue_depth("reward", self.rewards.pending_groups())
            self.exporter.set_cluster(
                len(self.engines), len(self.rewards.workers), len(self.learner.ranks)
            )

    def _next_prompts(self) -> list[Prompt]:
        return list(islice(self.prompts, self.cfg.rollout.prompts_per_step))

    # ----- evaluation ---------------------------------------------------------------------------
    def evaluate(self) -> float:
        """Greedy accuracy on the held-out set, split across the engines."""
        n = len(self.engines)
        shards = [self.eval_set[i::n] for i in range(n)]
        outs = ray.get(
            [
                e.greedy.remote(s, self.sampling.max_tokens)
                for e, s in zip(self.engines, shards, strict=True)
            ]
        )
        prompts = [p for shard in shards for p in shard]
        return greedy_accuracy(self.task, prompts, [t for texts in outs for t in texts])

    # ----- one step -----------------------------------------------------------------------------
    def _sequences(self, scored: list[ScoredGroup]) -> list[TrainSequence]:
        rewards, groups, counts = [], [], []
        for gid, sg in enumerate(scored):
            for r, resp in zip(sg.rewards, sg.group.responses, strict=True):
                rewards.append(r)
                groups.append(gid)
                counts.append(len(resp.token_ids))
        adv = compute_advantages(
            torch.tensor(rewards, dtype=torch.float64),
            torch.tensor(groups),
            self.cfg.algorithm.advantage,
            self.cfg.algorithm.std,
            token_counts=torch.tensor(counts, dtype=torch.float64),
        ).tolist()
        seqs, k = [], 0
        for gid, sg in enumerate(scored):
            for resp in sg.group.responses:
                seqs.append(
                    TrainSequence(
                        input_ids=sg.group.prompt_ids + resp.token_ids,
                        prompt_len=len(sg.group.prompt_ids),
                        advantage=adv[k],
                        reward=rewards[k],
                        group_id=gid,
                        policy_version=sg.group.policy_version,
                        vllm_logprobs=resp.logprobs,
                    )
                )
                k += 1
        return seqs

    def train(self, writer: MetricsWriter, progress: ProgressReporter) -> None:
        cfg = self.cfg
        stale = cfg.trainer.max_staleness
        last_end = time.monotonic()
        pending = self._collect(self._launch(self._next_prompts()))
        for step in range(1, cfg.trainer.steps + 1):
            more = step < cfg.trainer.steps
            scored, t_gen, t_reward = pending
            if cfg.algorithm.dynamic_sampling:
                scored = self._drop_flat_groups(scored)
            seqs = self._sequences(scored)
            staleness = [self.version - s.policy_version for s in seqs]
            if max(staleness, default=0) > stale:
                raise RuntimeError(
                    f"a sample {max(staleness)} versions old exceeds max_staleness={stale}"
                )
            # Overlap: the engines generate the next step with the current weights meanwhile.
            inflight = self._launch(self._next_prompts()) if stale and more else None
            t1 = time.monotonic()
            results = self.learner.train_step(seqs)
            t2 = time.monotonic()
            if inflight is not None:
                pending = self._collect(inflight)
            t3 = time.monotonic()
            self.version += 1
            self.transport.sync(self.learner, self.engines, self.version)
            t4 = time.monotonic()
            if not stale and more:
                pending = self._collect(self._launch(self._next_prompts()))
            t5 = time.monotonic()
            record = step_metrics(step, self.version, scored, seqs, results, staleness)
            now = time.monotonic()
            record["time_metrics_s"] = now - t5
            record.update(
                reward_errors=self.rewards.errors,
                reward_timeouts=self.rewards.timeouts,
                time_gen_s=t_gen,
                time_reward_s=t_reward,
                time_learn_s=t2 - t1,
                time_wait_gen_s=t3 - t2,
                time_sync_s=t4 - t3,
                time_step_s=now - last_end,
            )
            last_end = now
            record["gen_tokens_per_s"] = record["tokens_generated"] / max(t_gen, 1e-9)
            if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0 and more:
                record["eval_accuracy"] = self.evaluate()
            writer.write(record)
            progress.update(record)
            if self.exporter is not None:
                self.exporter.observe_step(record)
                self._export_queues()

    def _drop_flat_groups(self, scored: list[ScoredGroup]) -> list[ScoredGroup]:
        """Dynamic sampling (DAPO): groups whose rewards are all equal teach nothing; draw more."""
        keep = [g for g in scored if len(set(g.rewards)) > 1]
        for _ in range(3):
            if len(keep) >= len(scored):
                break
            extra, _, _ = self._collect(self._launch(self._next_prompts()))
            keep += [g for g in extra if len(set(g.rewards)) > 1]
        return keep[: len(scored)] or scored


def fresh_run_dir(run_dir: Path) -> Path:
    """An empty run directory; an earlier run of the same name is kept, renamed by its time."""
    if run_dir.exists() and any(run_dir.iterdir()):
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(run_dir.stat().st_mtime))
        kept = run_dir.with_name(f"{run_dir.name}.{stamp}")
        run_dir.rename(kept)
        log.info("kept the earlier run %s as %s", run_dir, kept)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def run(cfg: Config) -> dict:
    """Run one training job; returns the summary also written to summary.json."""
    model_path = resolve_model_path(cfg)
    run_dir = fresh_run_dir(Path(cfg.trainer.output_dir) / cfg.trainer.run_name)
    (run_dir / "config.resolved.yaml").write_text(cfg.dump_yaml())
    exporter = None
    if cfg.metrics.prometheus_port is not None:
        try:
            exporter = PrometheusExporter(
                cfg.trainer.run_name, cfg.metrics.prometheus_port, cfg.metrics.prometheus_addr
            )
        except OSError as err:
            raise RunError(
                f"metrics.prometheus_port: cannot serve on "
                f"{cfg.metrics.prometheus_addr}:{cfg.metrics.prometheus_port} ({err.strerror})"
            ) from None
        log.info(
            "Prometheus metrics on http://%s:%d/metrics", cfg.metrics.prometheus_addr, exporter.port
        )
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address=cfg.cluster.address, num_cpus=cfg.cluster.num_cpus, log_to_driver=False)
    trainer = Trainer(cfg, exporter)
    try:
        t0 = time.monotonic()
        trainer.start(model_path)
        log.info("actors up in %.1fs", time.monotonic() - t0)
        warm = trainer.evaluate()
        log.info("held-out greedy accuracy before training: %.3f", warm)
        with MetricsWriter(run_dir / "metrics.jsonl") as writer, ProgressReporter(cfg) as progress:
            trainer.train(writer, progress)
        write_plots(run_dir / "metrics.jsonl", run_dir)
        final = trainer.evaluate()
        log.info("held-out greedy accuracy after training: %.3f", final)
        model_dir = run_dir / "model"
        trainer.learner.save_pretrained(str(model_dir))
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (Path(model_path) / name).is_file():
                shutil.copy(Path(model_path) / name, model_dir / name)
        summary = {
            "steps": cfg.trainer.steps,
            "warm_start_accuracy": warm,
            "final_accuracy": final,
            "policy_version": trainer.version,
            "wall_time_s": time.monotonic() - t0,
            "model_dir": str(model_dir),
        }
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary
    finally:
        trainer_shutdown(trainer)
        if exporter is not None:
            exporter.close()
        if started_ray:
            ray.shutdown()


def trainer_shutdown(trainer: Trainer) -> None:
    """Stop the job's actors; on a shared cluster nothing else would."""
    if getattr(trainer, "learner", None) is not None:
        trainer.learner.shutdown()
    for actor in getattr(trainer, "engines", []) + getattr(
        getattr(trainer, "rewards", None), "workers", []
    ):
        ray.kill(actor)
