"""One training run from start to end: open it, start the job's peers, train, finish it.

The job loop itself is groupflow/loop/job.py; this module tells the story around it: the inputs
checked (groupflow/run/inputs.py), the run's name held and its directory made
(groupflow/run/directory.py), the Prometheus endpoint served, Ray joined, the actors started and
stopped, and what a run leaves behind when it ends.
"""

from __future__ import annotations

import json
import logging
import os
import time
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import ray

from groupflow.actors.futures import RayFutures
from groupflow.actors.transport_registry import transport_class
from groupflow.config import Config, ray_client_refusal, resolved_yaml
from groupflow.core.adapters import adapter_shape
from groupflow.core.errors import CheckpointError, RunError
from groupflow.core.model_dir import read_model_config
from groupflow.core.recovery import LearnerLost, RestartBudget
from groupflow.loop.checkpoint import (
    Checkpointing,
    CheckpointStore,
    Provenance,
    check_fit,
    rewind_metrics,
)
from groupflow.loop.checkpointer import Resume, find_resume, read_checkpoint
from groupflow.loop.held_out import HeldOutSet
from groupflow.loop.job import TrainingJob
from groupflow.loop.saved_model import complete_saved_model
from groupflow.loop.scaling import Scaler, policy_for
from groupflow.loop.stopping import STOP_COMMAND, StopAborted, StopRequest, stop_on_signals
from groupflow.observe.driver_log import DriverLog
from groupflow.observe.environment_errors import TroubleWatch
from groupflow.observe.learning_signal import SpreadWatch, nothing_learned
from groupflow.observe.metrics import MetricsWriter, ProgressReporter
from groupflow.observe.plots import latest_run, read_records, write_plots
from groupflow.observe.progress import PhaseProgress, heartbeat
from groupflow.observe.prometheus import PrometheusExporter, serve_metrics
from groupflow.observe.sample_log import SampleLog
from groupflow.observe.trackers import open_trackers
from groupflow.reward_workers.tasks import make_task
from groupflow.run.directory import claim_run_name, fresh_run_dir
from groupflow.run.end import SUMMARY_FILE, already_finished, read_summary, stopped_line
from groupflow.run.inputs import check_inputs
from groupflow.run.job_actors import start_actors
from groupflow.run.job_prompts import job_tokenizer
from groupflow.run.live import CLUSTER_FILE, join_ray, write_cluster_file

log = logging.getLogger(__name__)


def read_resume(cfg: Config, store: CheckpointStore) -> Resume | None:
    """The checkpoint `trainer.resume` names, with its driver state (the one read of it), or
    None for a fresh run."""
    try:
        return find_resume(cfg.trainer.resume, store)
    except CheckpointError as err:
        raise RunError(str(err)) from None


def check_resume(cfg: Config, resume: Resume, model_path: str) -> None:
    """That `resume` can go on with this job: its model, ranks and adapters, its files
    (groupflow/loop/checkpoint.py `check_fit`) and steps left to train. Reads only: a refused
    checkpoint leaves the run as it was."""
    now = Provenance(
        model_config_json=read_model_config(model_path),
        num_ranks=cfg.learner.num_ranks,
        adapter=adapter_shape(cfg.learner.lora),
    )
    saved = resume.state
    try:
        check_fit(resume.checkpoint, saved.files, saved.provenance, now)
    except CheckpointError as err:
        raise RunError(str(err)) from None
    if saved.step > cfg.trainer.steps:
        raise RunError(
            f"trainer.steps: {cfg.trainer.steps}, but {resume.checkpoint} was saved after step "
            f"{saved.step}"
        )


def prepare_run_dir(cfg: Config, run_dir: Path, resume: Resume | None) -> Path:
    """The run directory, fresh or rewound to the checkpoint to resume from (which is
    checked by now), with the config beside the records; a failed write is one line."""
    try:
        if resume is None:
            run_dir = fresh_run_dir(run_dir)
        else:
            log.info("resuming after step %d from %s", resume.state.step, resume.checkpoint)
            run_dir.mkdir(parents=True, exist_ok=True)
            rewind_metrics(run_dir / "metrics.jsonl", resume.state.step)
        (run_dir / "config.resolved.yaml").write_text(resolved_yaml(cfg))
    except OSError as err:
        raise RunError(f"{err.filename or run_dir}: {err.strerror}") from None
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
    store: CheckpointStore  # the run's checkpoints: its one store
    resume: Resume | None
    lock: int  # the held run name (claim_run_name)
    prompts_left_out: dict[str, int]  # by prompt source, too long for the engines at vetting

    def close(self) -> None:
        (self.run_dir / CLUSTER_FILE).unlink(missing_ok=True)  # the run is no longer live
        if self.exporter is not None:
            self.exporter.close()
        if self.started_ray:
            ray.shutdown()
        os.close(self.lock)


def open_run(cfg: Config, store: CheckpointStore, resume: Resume | None) -> OpenRun:
    """Check the inputs, hold the run name, check the checkpoint to resume from (`resume`,
    of `store`), and only then make (or rewind) the run directory; serve metrics and connect
    to Ray."""
    if cfg.cluster.address is None and not ray.is_initialized():  # ray.init reads RAY_ADDRESS
        refusal = ray_client_refusal(os.environ.get("RAY_ADDRESS"))
        if refusal is not None:
            raise RunError(f"RAY_ADDRESS: {refusal}")
    checked = check_inputs(cfg)
    model_path, prompts_left_out = checked.model_path, checked.prompts.left_out
    output_dir = Path(cfg.trainer.output_dir)
    run_dir = output_dir / cfg.trainer.run_name
    with ExitStack() as undo:
        lock = claim_run_name(output_dir, cfg.trainer.run_name)
        undo.callback(os.close, lock)
        if resume is not None:
            check_resume(cfg, resume, model_path)
        exporter = serve_metrics(cfg)
        if exporter is not None:
            undo.callback(exporter.close)
            exporter.set_prompts_left_out(prompts_left_out)
        run_dir = prepare_run_dir(cfg, run_dir, resume)
        undo.pop_all()
    started_ray = not ray.is_initialized()
    if started_ray:
        join_ray(cfg.cluster.address, num_cpus=cfg.cluster.num_cpus, log_to_driver=False)
    # Where `groupflow scale` and `groupflow status` find this job's cluster (groupflow/run/live.py).
    try:
        write_cluster_file(run_dir, cfg.trainer.run_name, ray.get_runtime_context().gcs_address)
    except Exception as err:  # e.g. through Ray Client (ray://), which has no GCS address
        log.warning("groupflow scale/status will not find this run here: %s", err)
    return OpenRun(
        cfg,
        model_path,
        run_dir,
        exporter,
        started_ray,
        time.monotonic(),
        store,
        resume,
        lock,
        prompts_left_out,
    )


def start_job(run: OpenRun, stop: StopRequest | None = None) -> TrainingJob:
    """Start the engines, the reward workers and the learner ranks; on a failure, stop
    those already started. `groupflow stop` reaches `stop` through the job's control actor."""
    cfg = run.cfg
    log.info(
        "starting the actors: engines %d, reward workers %d, learner ranks %d",
        cfg.rollout.num_engines,
        cfg.reward.num_workers,
        cfg.learner.num_ranks,
    )
    restarts = RestartBudget(cfg.trainer.max_restarts)  # engines and learner ranks share it
    # one heartbeat for the whole start: each of its waits may be short, together they are not
    with heartbeat(PhaseProgress("starting the actors")) as progress, ExitStack() as undo:
        actors = start_actors(cfg, run.model_path, restarts, progress, undo)
        if actors.inbox is not None and stop is not None:
            stop.poll = actors.inbox.stop_asked
        held_out_sets = []
        for eval_set in cfg.task.eval_sets:
            held_out_sets.append(HeldOutSet(eval_set, cfg.reward.plugin_timeout_s))
            undo.callback(held_out_sets[-1].close)
        job = TrainingJob(
            cfg,
            make_task(cfg.task.name, cfg.task.options),
            generators=actors.generators,
            rewards=actors.rewards,
            learner=actors.learner,
            transport=actors.transport,
            futures=RayFutures(),
            restarts=restarts,
            exporter=run.exporter,
            held_out_sets=held_out_sets,
            scaler=Scaler(
                cfg.trainer.run_name,
                actors.generators,
                actors.rewards,
                actors.learner.num_ranks,
                inbox=actors.inbox,
                policy=policy_for(cfg),
                gauges=run.exporter,
                log=log.info,
            ),
            stop=stop,
            sample_log=SampleLog(run.run_dir, cfg.trainer, job_tokenizer(run.model_path).decode),
            checkpointing=Checkpointing(
                run.store,
                read_model_config(run.model_path),
                partial(complete_saved_model, run.model_path, chat_template=cfg.task.chat_template),
            ),
        )
        undo.pop_all()
    log.info("actors up in %.1fs", time.monotonic() - run.started)
    log.info("learner: %s", actors.learner.checkpointing_line())
    return job


def train(run: OpenRun, job: TrainingJob) -> None:
    """Train to the last step. A dead learner rank takes the ranks down: they are rebuilt
    from the newest checkpoint and the job goes on from there, metrics.jsonl rewound to it
    (a restart of the job's budget: groupflow/core/recovery.py)."""
    metrics = run.run_dir / "metrics.jsonl"
    store = run.store
    trackers = open_trackers(run.cfg, run.run_dir)
    watches = [SpreadWatch(), TroubleWatch(run.cfg.agent.trajectory_setting)]
    while True:
        try:
            with MetricsWriter(metrics) as writer, ProgressReporter(run.cfg) as progress:
                job.train([writer, progress, *watches, *trackers])
            break
        except LearnerLost as err:
            lost_at = time.monotonic()
            transport = run.cfg.rollout.weight_transport
            if not transport_class(transport).elastic:
                raise RunError(
                    f"{err}; rebuilding the learner needs new ranks in the weight transport, "
                    f"and rollout.weight_transport={transport} keeps the members it opened with"
                ) from err
            checkpoint = store.newest()
            if checkpoint is None:
                raise RunError(
                    f"{err}, and there is no checkpoint to rebuild the learner from "
                    "(set trainer.checkpoint_every)"
                ) from err
            log.warning("%s; rebuilding the learner from %s", err, checkpoint)
            state = read_checkpoint(
                checkpoint,
                read_model_config(run.model_path),
                run.cfg.learner.num_ranks,
                adapter_shape(run.cfg.learner.lora),
            )
            job.recover_learner(checkpoint, state, str(err))
            rewind_metrics(metrics, state.step)
            log.info("learner back at step %d in %.1fs", state.step, time.monotonic() - lost_at)
    for tracker in trackers:
        tracker.close()


def finish_run(run: OpenRun, job: TrainingJob, warm_accuracy: float | None) -> dict:
    """Plots, the final evaluation, the model and summary.json; returns the summary. A run
    stopped early (groupflow/loop/stopping.py) has no final evaluation: its summary says where
    it stopped, and the model is the policy of the last step trained."""
    metrics = run.run_dir / "metrics.jsonl"
    write_plots(metrics, run.run_dir)
    final_scores = None
    if not job.stopped:
        final_scores = job.evaluation.scores()
        log.info("held-out greedy accuracy after training: %.3f", final_scores["eval_accuracy"])
        export_held_out(run, final_scores)
    model_dir = run.run_dir / "model"
    job.learner.save_pretrained(str(model_dir))
    complete_saved_model(run.model_path, model_dir, run.cfg.task.chat_template)
    every = run.cfg.trainer.checkpoint_every
    newest = run.store.newest() if every else None
    summary = {
        "steps": run.cfg.trainer.steps,
        "step_reached": job.last_step,
        "stopped": job.stopped,
        "stopped_by": job.stopping.request.source if job.stopped else None,
        "warm_start_accuracy": warm_accuracy,
        "final_accuracy": None if final_scores is None else final_scores["eval_accuracy"],
        "warm_start_eval": job.evaluation.before_training,
        "final_eval": final_scores,
        "policy_version": job.pipeline.version,
        "resumed_from_step": run.resume.state.step if run.resume is not None else None,
        "prompts_left_out": run.prompts_left_out,
        "wall_time_s": time.monotonic() - run.started,  # of this process
        "run_dir": str(run.run_dir),
        "model_dir": str(model_dir),
        "nothing_learned": nothing_learned(latest_run(read_records(metrics))),
        "checkpoint": None if newest is None else str(newest),
        "checkpoint_every": every,
    }
    (run.run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=1))
    if final_scores is not None and run.exporter is not None and run.exporter.await_scrape():
        log.info("Prometheus has read the final held-out scores")
    return summary


def export_held_out(run: OpenRun, scores: dict) -> None:
    """Held-out scores measured outside a step to Prometheus (the dashboard's accuracy panel
    has them whatever trainer.eval_every is)."""
    if run.exporter is not None:
        run.exporter.observe_held_out(scores)


def end_stopped(run: OpenRun, job: TrainingJob, warm: float | None, how_to_resume: str) -> dict:
    """A stopped run's files (finish_run) and the line saying what was written (the command
    line prints it), also told to `groupflow stop` through the control actor. A stop before
    any step was trained by this process writes nothing: summary.json, model/ and the plots
    stay as they were."""
    if job.last_step < job.first_step:
        summary = read_summary(run.run_dir) or {}
        line = f"stopped before step {job.first_step} was trained: nothing written"
    else:
        summary = finish_run(run, job, warm)
        line = stopped_line(summary, how_to_resume)
    if job.scaler is not None and job.scaler.inbox is not None:
        job.scaler.inbox.ended(line, reader=job.stopping.request.source == STOP_COMMAND)
    return {**summary, "end_line": line}


_NOTHING_TRAINED = "interrupted before training began: nothing trained, nothing saved"


def run(cfg: Config, how_to_resume: str = "groupflow train CONFIG --resume") -> dict:
    """Run one training job; returns the summary written to summary.json. Once training
    has begun, Ctrl-C, SIGTERM and `groupflow stop` stop it early (groupflow/loop/stopping.py);
    the summary returned then has `end_line`: what was written, and `how_to_resume`; so does
    a resume of a run that finished its steps already, which starts nothing. What the driver
    says is also kept in runs/<name>/driver.log (groupflow/observe/driver_log.py)."""
    run_dir = Path(cfg.trainer.output_dir) / cfg.trainer.run_name
    store = CheckpointStore(run_dir)
    resume = read_resume(cfg, store)
    finished = already_finished(cfg.trainer.resume, cfg.trainer.steps, run_dir, resume)
    if finished is not None:
        return {"end_line": finished}
    stop = StopRequest(cfg.trainer.stop_timeout_s)
    with DriverLog() as driver_log:
        try:
            opened = open_run(cfg, store, resume)
        except KeyboardInterrupt:
            log.warning(_NOTHING_TRAINED)
            raise
        job = None
        try:
            driver_log.open(opened.run_dir)
            job = start_job(opened, stop)
            if opened.resume is not None:
                job.restore(opened.resume.checkpoint, opened.resume.state)
                warm = job.evaluation.before_training.get("eval_accuracy")
                if warm is not None:  # None: a checkpoint of an older groupflow
                    export_held_out(opened, {"warm_start_accuracy": warm})
            else:
                warm_eval = job.evaluation.score_before()
                warm = warm_eval["eval_accuracy"]
                log.info("held-out greedy accuracy before training: %.3f", warm)
                export_held_out(opened, {"warm_start_accuracy": warm, **warm_eval})
            with stop_on_signals(stop):
                train(opened, job)
                if job.stopped:
                    return end_stopped(opened, job, warm, how_to_resume)
                return finish_run(opened, job, warm)
        except StopAborted as err:
            newest = opened.store.newest()
            log.warning(
                "%s; %s", err, f"the newest checkpoint is {newest}" if newest else "no checkpoint"
            )
            raise
        except KeyboardInterrupt:
            log.warning(_NOTHING_TRAINED)
            raise
        finally:
            if job is not None:
                job.shutdown()
                if job.scaler is not None:
                    job.scaler.close()
            opened.close()
