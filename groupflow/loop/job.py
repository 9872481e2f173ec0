"""The job loop: one training job, step after step, over four peers.

prompts -> generator pool -> reward pool -> advantages -> learner -> weight transport -> engines.

A step (`_step`) takes its groups from the prompt stream (prompt_stream.py) as soon as each is
scored, masks the failures not the model's (infra_failures.py), turns them into training
sequences with their advantages, trains the learner on them, sends the new version to the
engines and writes its record. It blocks in four stages of its record (`wait_rollout`,
`reward`, `learn`, `sync`), each in the pipeline's one wait (pipeline.py, the owner of the
policy version), where generation and scoring go on. A lost learner rank raises LearnerLost,
and the driver rebuilds the ranks through `recover_learner`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Protocol

from groupflow.config import Config
from groupflow.core import peers
from groupflow.core.records import ScoredGroup, TrainSequence
from groupflow.core.recovery import LearnerLost, RestartBudget
from groupflow.core.timing import stage_timer, time_keys
from groupflow.learner.figures import learner_record
from groupflow.learner.lr_schedule import lr_at
from groupflow.loop.checkpoint import Checkpointing
from groupflow.loop.checkpointer import Checkpointer, DriverState
from groupflow.loop.held_out import HeldOutEvaluation, HeldOutSet
from groupflow.loop.infra_failures import InfraFailures
from groupflow.loop.live_series import LiveSeries
from groupflow.loop.pipeline import Pipeline
from groupflow.loop.prompt_stream import PromptStream
from groupflow.loop.reward_totals import RewardTotals
from groupflow.loop.scaling import Scaler
from groupflow.loop.sequences import group_advantages, train_sequences
from groupflow.loop.stopping import LoopStop, StepAbandoned, StopRequest
from groupflow.loop.unscored import UnscoredSteps
from groupflow.observe.prometheus import PrometheusExporter
from groupflow.observe.rollout_figures import rollout_record
from groupflow.reward_workers.tasks.base import Task


class StepSink(Protocol):
    def write(self, record: dict) -> None: ...


class TrainingJob:
    """Runs `trainer.steps` steps over the peers it is given (see groupflow.core.peers). The
    generator pool charges its engine replacements to the same `restarts` budget."""

    def __init__(
        self,
        cfg: Config,
        task: Task,
        *,
        generators: peers.Generation,
        rewards: peers.Scoring,
        learner: peers.Learner,
        transport: peers.WeightSync,
        futures: peers.Futures,
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
        self.sample_log = sample_log
        self.scaler = scaler  # resizes the pools between steps (groupflow/loop/scaling.py)
        per_step = cfg.rollout.prompts_per_step
        self.stream = PromptStream(
            cfg, task, lambda: peers.chunk_size(per_step, self.generators.figures().engines)
        )
        self.live = LiveSeries(generators, rewards, learner, scaler, exporter, clock)
        self.stopping = LoopStop(stop, cfg.trainer.steps)  # its request: job.stopping.request
        self.pipeline = Pipeline(
            self.stream, generators, rewards, transport, futures, self._heartbeat, clock
        )
        self.evaluation = HeldOutEvaluation(
            cfg, task.eval_prompts(cfg.task.eval_size), self.pipeline, held_out_sets
        )
        self.reward_totals = RewardTotals(rewards)
        parts = dict(prompt_stream=self.stream, restarts=restarts, held_out=self.evaluation)
        parts["reward_totals"] = self.reward_totals
        self.checkpointer = Checkpointer(cfg, checkpointing, learner, self.pipeline, parts)
        self.unscored = UnscoredSteps(cfg.reward.max_unscored_steps)
        self.infra = InfraFailures(cfg)
        self.first_step, self.last_step = 1, 0  # this process's first step, the last trained
        self.stopped = False  # ended by a stop request before trainer.steps

    def train(self, sinks: Sequence[StepSink]) -> None:
        """Run the steps; each step record goes to every sink (metrics.jsonl, progress). A stop
        request ends the loop after the step in flight, or abandons a step whose samples are
        late (groupflow/loop/stopping.py); `stopped` says so, and the last step trained is saved."""
        for step in range(self.first_step, self.cfg.trainer.steps + 1):
            if self.stopping.asked(self.last_step):
                self.stopped = True
                break
            try:
                record = self._step(step)
            except StepAbandoned:
                self.stopped = True
                break
            if self.scaler is not None:  # the pools change only here, between steps
                record.update(self.scaler.between_steps(record))
            for sink in sinks:
                sink.write(record)
            self.live.step_ended(record)
            self.restarts.step_done(step)
            self.last_step = step
            self.checkpointer.step_ended(step, lambda: not self.stopping.asked(self.last_step))
        if self.stopped:
            self.stream.stop_drawing()
            self.checkpointer.save_at_stop(self.last_step)

    def _heartbeat(self) -> None:
        """While the loop waits: the live series, and a stop asked meanwhile."""
        self.live.heartbeat()
        self.stopping.check_waiting(self.last_step)

    def _step(self, step: int) -> dict:
        started, times = time.monotonic(), {}
        self.live.step_started(step)
        idle_before = self.generators.figures().idle_engine_s
        self.stopping.waiting_for = step
        scored = partial(self.pipeline.scored, times=times)
        taken = self.stream.take_step(step, self.pipeline.version, scored)
        while not self.unscored.trainable(taken.groups) or not (
            masked := self.infra.mask(taken.groups)
        ):
            taken = self.stream.take_step(step, self.pipeline.version, scored)
        self.stopping.waiting_for = None  # from here the step runs to its end
        self.pipeline.feed()  # the next steps' chunks generate while this one learns
        self.live.publish()
        advantages = group_advantages(masked.groups, self.cfg)
        if self.sample_log is not None:
            self.sample_log(step, taken.groups, masked.spread(advantages))
        seqs = train_sequences(masked.groups, advantages, self.cfg.algorithm)
        staleness = [self.pipeline.version - s.policy_version for s in seqs]
        lr = lr_at(self.cfg.learner.optimizer, step, self.cfg.trainer.steps)
        results = self._learn(seqs, times, lr)
        times["gen"] = taken.generation_s
        with stage_timer("metrics", times):
            record = {"step": step, "policy_version": self.pipeline.version, "lr": lr}
            record.update(rollout_record(masked.groups, staleness, times, taken.groups))
            record.update(learner_record(results) | masked.figures())
            record.update(groups_dropped_stale=taken.dropped_stale, groups_filtered=taken.filtered)
            record.update(self.pipeline.step_figures())
        record.update(self.reward_totals.state_dict() | self.restarts.state_dict())
        record.update(self.checkpointer.figures())
        every = self.cfg.trainer.eval_every
        if every and step % every == 0 and step < self.cfg.trainer.steps:  # the run ends with one
            record.update(self.evaluation.scores())
        times["step"] = time.monotonic() - started
        rollout = self.generators.figures()
        times["engines_idle"] = (rollout.idle_engine_s - idle_before) / max(1, rollout.engines)
        record.update(time_keys(times))
        return record

    def _learn(self, seqs: list[TrainSequence], times: dict[str, float], lr: float) -> list:
        """One learner step, then the new version sent to the engines; the ranks' results."""
        with stage_timer("learn", times), self.pipeline.learning():
            try:
                results = self.pipeline.wait_for(self.learner.async_train_step(seqs, lr))
            except peers.PeerDied as err:
                raise LearnerLost(f"a learner rank died in a step: {err}") from err
        with stage_timer("sync", times):
            self.pipeline.sync_engines(wait_for_engines=False)
        return results

    def restore(self, checkpoint: Path, state: DriverState) -> None:
        """Continue where `checkpoint` left off."""
        self.checkpointer.restore(checkpoint, state)
        self.first_step, self.last_step = state.step + 1, state.step

    def recover_learner(self, checkpoint: Path, state: DriverState, cause: str = "") -> None:
        """After LearnerLost: one restart, new ranks, and the whole job back at `checkpoint`
        (later steps are trained again; the rollouts in flight finish and are dropped)."""
        self.restarts.charge("learner", cause or "a learner rank died")
        self.pipeline.abandon()
        self.learner.restart()
        self.restore(checkpoint, state)

    def shutdown(self) -> None:
        """Stop the job's actors (on a shared cluster nothing else would) and scorers."""
        self.learner.shutdown()
        self.generators.shutdown()
        self.rewards.shutdown()
        self.evaluation.close()
