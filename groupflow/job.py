"""The job loop: one training job, step after step, over four peers.

prompts -> generator pool -> reward pool -> advantages -> learner -> weight transport -> engines.

A step (`_step`) takes its groups from the prompt stream as soon as each is scored
(groupflow/prompt_stream.py: what is drawn when, staleness, refills), turns them into training
sequences with their advantages, trains the learner on them, sends the new version to the
engines and writes its record. The loop blocks in four places, each a stage of the step record:
the next group's generation (`wait_rollout`) and then its scores (`reward`), the learner's step
(`learn`) and the learner's side of the weight sync (`sync`). Each wait is the pipeline's
(groupflow/pipeline.py): whatever it waits on, chunks flow from the engines to the reward pool
and engines with room take the next ones, so generation and scoring overlap learning.

Every `trainer.eval_every` steps the job evaluates on held-out prompts (groupflow/held_out.py).
Every `trainer.checkpoint_every` steps it saves a checkpoint: the ranks save their shards while
the engines already generate, and the driver's state says where the prompt stream stood, so a
resumed job (`restore`) trains the same prompts in the same order.

Recovery draws on one restart budget (groupflow/recovery.py): a dead engine is replaced by the
generator pool and healed by the pipeline; a dead learner rank raises LearnerLost, and the
driver rebuilds the ranks through `recover_learner` with the newest checkpoint. Its live status
and series are groupflow/live_series.py's, published after each step and at the heartbeats of
a step that waits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from groupflow.adapters import adapter_shape
from groupflow.checkpoint import HF_DIR, LEARNER_DIR, Checkpointing, DriverState
from groupflow.config import Config, resolved_yaml
from groupflow.held_out import HeldOutEvaluation, HeldOutSet
from groupflow.learner.figures import learner_record
from groupflow.learner.lr_schedule import lr_at
from groupflow.live_series import LiveSeries
from groupflow.peers import (
    Futures,
    Generation,
    Learner,
    PeerDied,
    Scoring,
    WeightSync,
    chunk_size,
)
from groupflow.pipeline import Pipeline
from groupflow.prometheus import PrometheusExporter
from groupflow.prompt_stream import PromptStream, StepGroups
from groupflow.records import ScoredGroup, TrainSequence
from groupflow.recovery import LearnerLost, RestartBudget
from groupflow.reward_workers.tasks.base import Task
from groupflow.rollout_figures import rollout_record
from groupflow.scaling import Scaler
from groupflow.sequences import group_advantages, train_sequences
from groupflow.stopping import StepAbandoned, StopRequest
from groupflow.timing import stage_timer, time_keys
from groupflow.unscored import UnscoredSteps

log = logging.getLogger(__name__)


class StepSink(Protocol):
    def write(self, record: dict) -> None: ...


class TrainingJob:
    """Runs `trainer.steps` steps over the peers it is given (see groupflow.peers). The
    generator pool charges its engine replacements to the same `restarts` budget."""

    def __init__(
        self,
        cfg: Config,
        task: Task,
        *,
        generators: Generation,
        rewards: Scoring,
        learner: Learner,
        transport: WeightSync,
        futures: Futures,
        restarts: RestartBudget,
        exporter: PrometheusExporter | None = None,
        checkpointing: Checkpointing | None = None,
        sample_log: Callable[[int, list[ScoredGroup], list[list[float]]], None] | None = None,
        held_out_sets: Sequence[HeldOutSet] = (),
        scaler: Scaler | None = None,
        stop: StopRequest | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cfg = cfg
        self.generators = generators
        self.rewards = rewards
        self.learner = learner
        self.restarts = restarts
        self.checkpointing = checkpointing
        self.sample_log = sample_log
        self.scaler = scaler  # resizes the pools between steps (groupflow/scaling.py)
        per_step = cfg.rollout.prompts_per_step
        self.stream = PromptStream(
            cfg, task, lambda: chunk_size(per_step, self.generators.figures().engines)
        )
        self.live = LiveSeries(generators, rewards, learner, scaler, exporter, clock)
        self.stop = stop
        self.pipeline = Pipeline(
            self.stream, generators, rewards, transport, futures, self._heartbeat, clock
        )
        self.evaluation = HeldOutEvaluation(
            cfg, task.eval_prompts(cfg.task.eval_size), self.pipeline, held_out_sets
        )
        self.unscored = UnscoredSteps(cfg.reward.max_unscored_steps)
        self.version = 0
        self.first_step = 1
        self.last_step = 0  # the last step trained
        self.stopped = False  # ended by a stop request before trainer.steps
        self._waiting_for_samples = False  # a step that a stop may abandon
        self._stream_state = self.stream.state_dict()  # after the last step trained
        self.warm_accuracy: float | None = None
        self.warm_eval: dict = {}  # every held-out score before training (evaluate())
        # Running totals carried over from the checkpoint a job resumed from.
        self._totals_before = {"reward_errors": 0.0, "reward_timeouts": 0.0}
        self._last_save: float | None = None  # seconds the newest save took
        self._saved_at = time.monotonic()  # when the newest checkpoint was complete
        self._saved_step: int | None = None  # the step of the newest checkpoint

    def train(self, sinks: Sequence[StepSink]) -> None:
        """Run the steps; each step record goes to every sink (metrics.jsonl, progress). A
        stop request (groupflow/stopping.py) ends the loop after the step in flight, or
        abandons that step when its samples are late; `stopped` then says so, and the
        checkpoint of the last step trained is saved if checkpointing is on."""
        for step in range(self.first_step, self.cfg.trainer.steps + 1):
            if self._stop_asked():
                self.stopped = True
                break
            try:
                record = self._step(step)
            except StepAbandoned:
                self._waiting_for_samples = False
                log.warning(
                    "step %d abandoned: its samples were not in within %gs of the stop",
                    step,
                    self.stop.deadline_s,
                )
                self.stopped = True
                break
            if self.scaler is not None:  # the pools change only here, between steps
                record.update(self.scaler.between_steps(record))
            for sink in sinks:
                sink.write(record)
            self.live.step_ended(record)
            self.restarts.step_done(step)
            self.last_step, self._stream_state = step, self.stream.state_dict()
            every = self.cfg.trainer.checkpoint_every
            if self.checkpointing is not None and every > 0 and step % every == 0:
                self._save_checkpoint(step, draw_next=not self._stop_asked())
        if self.stopped:
            self._save_on_stop()

    def _stop_asked(self) -> bool:
        """Whether to end the job before its next step (only ever before the last step)."""
        if self.stop is None or self.last_step >= self.cfg.trainer.steps:
            return False
        return self.stop.check()

    def _heartbeat(self) -> None:
        """While the loop waits: the live series, and a stop asked meanwhile; a step still
        waiting for its samples past the stop's deadline is abandoned."""
        self.live.heartbeat()
        if self._stop_asked() and self._waiting_for_samples and self.stop.overdue():
            raise StepAbandoned

    def _save_on_stop(self) -> None:
        """Stopped early: draw nothing more, and save the last step trained as a checkpoint
        if checkpointing is on and it is not saved already."""
        self.stream.stop_drawing()
        every = self.cfg.trainer.checkpoint_every
        if self.checkpointing is None or every == 0 or self.last_step == 0:
            return
        if self._saved_step != self.last_step:
            self._save_checkpoint(self.last_step, draw_next=False)

    def _step(self, step: int) -> dict:
        started, times = time.monotonic(), {}
        self.live.step_started(step)
        idle_before = self.generators.figures().idle_engine_s
        self._waiting_for_samples = True
        taken = self._take_groups(step, times)
        while not self.unscored.trainable(taken.groups):  # never train on nothing
            taken = self._take_groups(step, times)
        self._waiting_for_samples = False  # from here the step runs to its end
        self.pipeline.feed()  # the next steps' chunks generate while this one learns
        self.live.publish()
        advantages = group_advantages(taken.groups, self.cfg)
        if self.sample_log is not None:
            self.sample_log(step, taken.groups, advantages)
        seqs = train_sequences(taken.groups, advantages, self.cfg.algorithm)
        staleness = [self.version - s.policy_version for s in seqs]
        lr = lr_at(self.cfg.learner.optimizer, step, self.cfg.trainer.steps)
        results = self._learn(seqs, times, lr)
        times["gen"] = taken.generation_s
        with stage_timer("metrics", times):
            record = {"step": step, "policy_version": self.version, "lr": lr}
            record.update(rollout_record(taken.groups, staleness, times))
            record.update(learner_record(results))
            record["groups_dropped_stale"] = taken.dropped_stale
            record["groups_filtered"] = taken.filtered
            record["weight_sync_verified"] = self.pipeline.loads_verified  # since the last step
            self.pipeline.loads_verified = 0
        record.update(self._running_totals() | self.restarts.state_dict())
        if self.checkpointing is not None:
            record["seconds_since_checkpoint"] = time.monotonic() - self._saved_at
            if self._last_save is not None:
                record["checkpoint_seconds"] = self._last_save
        every = self.cfg.trainer.eval_every
        if every and step % every == 0 and step < self.cfg.trainer.steps:  # the run ends with one
            record.update(self.evaluate())
        times["step"] = time.monotonic() - started
        rollout = self.generators.figures()
        times["engines_idle"] = (rollout.idle_engine_s - idle_before) / max(1, rollout.engines)
        record.update(time_keys(times))
        return record

    def _take_groups(self, step: int, times: dict[str, float]) -> StepGroups:
        return self.stream.take_step(
            step, self.version, lambda chunk: self.pipeline.scored(chunk, times)
        )

    def _learn(self, seqs: list[TrainSequence], times: dict[str, float], lr: float) -> list:
        """One learner step, then the new version sent to the engines; the ranks' results."""
        with stage_timer("learn", times):
            self.pipeline.version = None  # mid-step, the learner has no version to send
            try:
                results = self.pipeline.wait_for(self.learner.async_train_step(seqs, lr))
            except PeerDied as err:
                raise LearnerLost(f"a learner rank died in a step: {err}") from err
            self.version += 1
            self.pipeline.version = self.version
        with stage_timer("sync", times):
            self.pipeline.sync_engines(wait_for_engines=False)
        return results

    def evaluate(self) -> dict[str, float | dict[str, float]]:
        """Held-out scores (blocking): eval_* of the task's own set, eval_set_* of the others."""
        return self.evaluation.scores()

    # ----- checkpoints and recovery -------------------------------------------------------------
    def _running_totals(self) -> dict[str, float]:
        before = self._totals_before
        return {
            "reward_errors": before["reward_errors"] + self.rewards.errors,
            "reward_timeouts": before["reward_timeouts"] + self.rewards.timeouts,
        }

    def _save_checkpoint(self, step: int, draw_next: bool = True) -> None:
        """Save the state after `step`: the ranks write their shards while the engines
        generate the next step's prompts (drawn first, at staleness 0, unless not
        `draw_next`). Says where, and how long it took."""
        started = time.monotonic()
        trainer, ckpt = self.cfg.trainer, self.checkpointing
        if draw_next and step < trainer.steps:
            self.stream.draw_ahead(self.cfg.rollout.prompts_per_step)
            self.pipeline.feed()
        staging = ckpt.store.staging(step)
        try:
            self.pipeline.wait_for(self.learner.async_save_checkpoint(str(staging / LEARNER_DIR)))
        except PeerDied as err:
            raise LearnerLost(f"a learner rank died in a checkpoint save: {err}") from err
        if trainer.save_hf_every and step % trainer.save_hf_every == 0:
            self.learner.save_pretrained(str(staging / HF_DIR))
            ckpt.add_tokenizer(staging / HF_DIR)
        state = DriverState(
            step=step,
            policy_version=self.version,
            stream=self._stream_state,
            warm_start_accuracy=self.warm_accuracy,
            warm_start_eval=self.warm_eval,
            counters=self._running_totals() | self.restarts.state_dict(),
            model_config_json=ckpt.model_config_json,
            num_ranks=self.learner.num_ranks,
            adapter=adapter_shape(self.cfg.learner.lora),
        )
        saved = ckpt.store.commit(staging, state, resolved_yaml(self.cfg), trainer.keep_checkpoints)
        self._saved_at = time.monotonic()
        self._last_save = self._saved_at - started
        self._saved_step = step
        log.info("checkpoint of step %d saved to %s in %.1fs", step, saved, self._last_save)

    def restore(self, checkpoint: Path, state: DriverState) -> None:
        """Continue where `checkpoint` left off: the learner's shards, the engines on its
        policy version, the prompt stream at its position, the running totals."""
        self.learner.load_checkpoint(str(checkpoint / LEARNER_DIR))
        self.version = self.pipeline.version = state.policy_version
        self.pipeline.sync_engines(wait_for_engines=True)
        self.first_step = state.step + 1
        self.last_step = self._saved_step = state.step
        self.warm_accuracy = state.warm_start_accuracy
        self.warm_eval = state.warm_start_eval
        self.stream.load_state_dict(state.stream)
        self._stream_state = state.stream
        self._totals_before = {k: state.counters.get(k, 0.0) for k in self._totals_before}
        self.restarts.load_state_dict(state.counters)

    def recover_learner(self, checkpoint: Path, state: DriverState) -> None:
        """After LearnerLost: one restart, new ranks, and the whole job back at `checkpoint`
        (the steps after it are trained again). The rollouts in flight are let finish and
        dropped."""
        self.restarts.charge("learner", "a learner rank died")
        self.pipeline.abandon()
        self.learner.restart()
        self.restore(checkpoint, state)

    def shutdown(self) -> None:
        """Stop the job's actors (on a shared cluster nothing else would) and scorers."""
        self.learner.shutdown()
        self.generators.shutdown()
        self.rewards.shutdown()
        self.evaluation.close()
