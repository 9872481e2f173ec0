"""The job loop: one training job as a pipeline over four peers.

prompts -> generator pool (chunks, handed on as each finishes) -> reward pool -> advantages
-> learner -> weight transport -> engines.

The peers place their own work (which engine, which reward worker, which rank); the loop only
decides what is launched next and where it waits. It blocks in four places, each a stage of
the step record: a rollout's generation and then its scores (`_finish`), the learner's step,
the chunks generating ahead of the weight load, and the weight sync. Whatever it waits on,
every chunk that finishes meanwhile goes to the reward pool at once, so scoring overlaps both
generation and learning.

Staleness: with `trainer.max_staleness` = k, the rollouts of the next k steps are in flight
(a queue of up to k) while a step trains. A rollout launched during step s samples from
version s-1 and is trained at step s+k by version s+k-1: exactly k versions old. k = 0 is
strictly on-policy.

Checkpoints (`trainer.checkpoint_every`): after a step's record is written, the ranks save
their shards while the next rollout already generates; the driver's state says where the
prompt stream stood, so a resumed job (`restore`) trains the same prompts in the same order.

Recovery: a dead engine is replaced by the generator pool; the loop sends the replacement the
current weights as soon as the learner is between steps, and the dead engine's chunks are
generated again. A dead learner rank raises LearnerLost: the driver rebuilds the ranks and
calls `recover_learner` with the newest checkpoint.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Protocol

from groupflow.checkpoint import HF_DIR, LEARNER_DIR, CheckpointStore, DriverState
from groupflow.config import Config
from groupflow.evaluate import HeldOutSet, greedy_share, sampled_scores
from groupflow.learner.figures import learner_record
from groupflow.learner.lr_schedule import lr_at
from groupflow.peers import (
    Futures,
    Generation,
    Handle,
    Learner,
    PeerDied,
    Scoring,
    WeightSync,
)
from groupflow.prometheus import PrometheusExporter
from groupflow.records import Prompt, SampledGroup, ScoredGroup, TrainSequence
from groupflow.reward_workers.tasks.base import Task
from groupflow.rollout_figures import rollout_record
from groupflow.sequences import group_advantages, train_sequences
from groupflow.timing import stage_timer, time_keys

# Dynamic sampling draws at most this many extra rollouts per step (DAPO keeps drawing; a
# bound keeps a task that is all-solved or all-failed from stalling the job).
MAX_REFILLS = 3

EVAL_ROLLOUT = -1  # the reward pool's rollout id for held-out answers (training's count from 0)


class LearnerLost(RuntimeError):
    """A learner rank died: the ranks must be rebuilt from a checkpoint."""


class StepSink(Protocol):
    def write(self, record: dict) -> None: ...


@dataclass
class Rollout:
    """One rollout's prompts in generation."""

    id: int
    started: float
    first_prompt: int  # its first prompt's position in the seeded prompt stream
    pending: set[Handle] = field(default_factory=set)  # chunks not yet handed on
    generated: float | None = None  # when its last chunk was handed on

    @property
    def generation_s(self) -> float:
        return (self.generated or self.started) - self.started


@dataclass
class Checkpointing:
    """Where a job saves its checkpoints, and what it tells about its model."""

    store: CheckpointStore
    model_config_json: dict  # the model's config.json, so that a resume can check the model
    add_tokenizer: Callable[[Path], None]  # completes a Hugging Face save with the tokenizer


class TrainingJob:
    """Runs `trainer.steps` steps over the peers it is given (see groupflow.peers)."""

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
        exporter: PrometheusExporter | None = None,
        learner_figures: Callable[[list], dict] = learner_record,
        checkpointing: Checkpointing | None = None,
        sample_log: Callable[[int, list[ScoredGroup], list[list[float]]], None] | None = None,
        held_out_sets: Sequence[HeldOutSet] = (),
    ):
        self.cfg = cfg
        self.task = task
        self.generators = generators
        self.rewards = rewards
        self.learner = learner
        self.transport = transport
        self.futures = futures
        self.exporter = exporter
        self.learner_figures = learner_figures
        self.checkpointing = checkpointing
        self.sample_log = sample_log
        self.held_out_sets = held_out_sets
        self.prompts = task.train_prompts(cfg.trainer.seed)
        self.eval_set = task.eval_prompts(cfg.task.eval_size)
        self.version = 0
        self.first_step = 1
        self.warm_accuracy: float | None = None
        self._prompts_taken = 0
        self._rollout_ids = 0
        self._generating: dict[int, Rollout] = {}
        self._undrained: set[int] = set()  # rollouts launched and not yet drained of scores
        # Running totals carried over from the checkpoint a job resumed from.
        self._totals_before = {"reward_errors": 0.0, "reward_timeouts": 0.0}
        self._last_save: float | None = None  # seconds the newest save took
        self._saved_at = time.monotonic()  # when the newest checkpoint was complete
        # The learner's parameters are the engines' current version only between steps:
        # a replaced engine can be sent the weights then.
        self._learner_between_steps = True
        self.learner_restarts = 0
        self._engine_restarts_before = 0  # from the checkpoint a job resumed from
        self._engine_restarts_at_step = 0  # the pool's count when the last step ended

    # ----- the steps ----------------------------------------------------------------------------
    def train(self, sinks: Sequence[StepSink]) -> None:
        """Run the steps; each step record goes to every sink (metrics.jsonl, progress)."""
        ahead: deque[Rollout] = deque()  # rollouts of the steps after the current one
        for step in range(self.first_step, self.cfg.trainer.steps + 1):
            record = self._step(step, ahead)
            for sink in sinks:
                sink.write(record)
            self._export(record)
            self._engine_restarts_at_step = self.generators.restarts
            if self._checkpoint_due(step):
                self._save_checkpoint(step, ahead)

    def _step(self, step: int, ahead: deque[Rollout]) -> dict:
        started, times = time.monotonic(), {}
        rollout = ahead.popleft() if ahead else self._launch()
        scored = self._finish(rollout, times)
        if self.cfg.algorithm.dynamic_sampling:
            scored = self._refill(scored, times)
        steps, k = self.cfg.trainer.steps, self.cfg.trainer.max_staleness
        while len(ahead) < k and step + len(ahead) < steps:
            ahead.append(self._launch())
        self._export_queues()
        advantages = group_advantages(scored, self.cfg)
        if self.sample_log is not None:
            self.sample_log(step, scored, advantages)
        seqs = train_sequences(scored, advantages, self.cfg.algorithm)
        staleness = [self.version - s.policy_version for s in seqs]
        if max(staleness, default=0) > k:
            raise RuntimeError(
                f"a sample {max(staleness)} versions old exceeds trainer.max_staleness={k}"
            )
        lr = lr_at(self.cfg.learner.optimizer, step, steps)
        results = self._learn(seqs, times, lr)
        times["gen"] = rollout.generation_s
        with stage_timer("metrics", times):
            record = {"step": step, "policy_version": self.version, "lr": lr}
            record.update(rollout_record(scored, staleness, times))
            record.update(self.learner_figures(results))
        record.update(self._running_totals() | self._restart_totals())
        if self.checkpointing is not None:
            record["seconds_since_checkpoint"] = time.monotonic() - self._saved_at
            if self._last_save is not None:
                record["checkpoint_seconds"] = self._last_save
        every = self.cfg.trainer.eval_every
        if every and step % every == 0 and step < steps:  # the run's own evaluation ends it
            record.update(self.evaluate())
        times["step"] = time.monotonic() - started
        record.update(time_keys(times))
        return record

    def _learn(self, seqs: list[TrainSequence], times: dict[str, float], lr: float) -> list:
        """One learner step, then the engines on the new version; the ranks' results."""
        with stage_timer("learn", times):
            self._learner_between_steps = False
            try:
                results = self.futures.get(
                    self._stream_until(self.learner.async_train_step(seqs, lr))
                )
            except PeerDied as err:
                raise LearnerLost(f"a learner rank died in a step: {err}") from err
            self.version += 1
            self._learner_between_steps = True
        # An engine loads weights only after the chunks already sent to it: wait for those
        # first, so that the sync's time is its own.
        with stage_timer("wait_gen", times):
            self._stream_until(self.generators.in_flight())
        with stage_timer("sync", times):
            self._sync_engines(stream=True)
        return results

    def _sync_engines(self, stream: bool) -> None:
        """Every engine on the learner's current version (it must be between steps). A dead
        engine met on the way is replaced and the sync sent again."""
        while True:
            restarts = self.generators.restarts
            handles = self.transport.async_sync(self.version)
            self._resend_lost(self.generators.weights_sent())
            try:
                self.futures.get(self._stream_until(handles) if stream else handles)
                return
            except PeerDied as err:
                self.generators.replace_dead()
                if self.generators.restarts == restarts:  # no engine died: a rank did
                    raise LearnerLost(f"a learner rank died in a weight sync: {err}") from err
                self._check_restarts()

    def _heal_engines(self) -> None:
        """Send replaced engines the current weights, and the chunks the dead ones held."""
        if self.generators.needs_weights():
            self._check_restarts()
            self._sync_engines(stream=False)
        else:
            self._resend_lost(self.generators.resend_lost())

    def _check_restarts(self) -> None:
        in_a_row = self.generators.restarts - self._engine_restarts_at_step
        if in_a_row > self.cfg.trainer.max_restarts:
            raise RuntimeError(
                f"engines died {in_a_row} times without a step between "
                f"(trainer.max_restarts={self.cfg.trainer.max_restarts})"
            )

    def _resend_lost(self, resent: dict[Handle, Handle]) -> None:
        for rollout in self._generating.values():
            for old in rollout.pending & resent.keys():
                rollout.pending.remove(old)
                rollout.pending.add(resent[old])

    def _refill(self, scored: list[ScoredGroup], times: dict[str, float]) -> list[ScoredGroup]:
        """Dynamic sampling (DAPO): groups whose rewards are all equal teach nothing; draw more
        rollouts for their places, up to MAX_REFILLS."""
        keep = [g for g in scored if len(set(g.rewards)) > 1]
        for _ in range(MAX_REFILLS):
            if len(keep) >= len(scored):
                break
            extra = self._finish(self._launch(), times)
            keep += [g for g in extra if len(set(g.rewards)) > 1]
        return keep[: len(scored)] or scored

    # ----- rollouts -----------------------------------------------------------------------------
    def _launch(self) -> Rollout:
        """The next `rollout.prompts_per_step` prompts, sent to the generator pool."""
        if self.generators.needs_weights():
            self._heal_engines()
        prompts = list(islice(self.prompts, self.cfg.rollout.prompts_per_step))
        rollout = Rollout(self._rollout_ids, time.monotonic(), self._prompts_taken)
        self._rollout_ids += 1
        self._undrained.add(rollout.id)
        self._prompts_taken += len(prompts)
        rollout.pending = set(self.generators.submit(prompts, rollout.id))
        if rollout.pending:
            self._generating[rollout.id] = rollout
        else:
            rollout.generated = rollout.started
        return rollout

    def _finish(self, rollout: Rollout, times: dict[str, float]) -> list[ScoredGroup]:
        """Block until the rollout is generated, then until it is scored. The wait for the
        generation is `wait_rollout`: the learner idle for want of samples."""
        with stage_timer("wait_rollout", times):
            while rollout.pending:  # a chunk lost with its engine is pending again, resent
                self._stream_until(list(rollout.pending))
        with stage_timer("reward", times):
            self._undrained.discard(rollout.id)
            return self.rewards.drain(rollout.id)

    def _stream_until(self, handles: Sequence[Handle]) -> Sequence[Handle]:
        """Block until every one of `handles` is ready, handing each generation chunk that
        finishes meanwhile to the reward pool at once. Returns `handles`."""
        waiting = set(handles)
        while waiting:
            chunks = set(self.generators.in_flight())
            ready = self.futures.wait_any(list(waiting | chunks))
            for chunk in self.generators.take(ready):
                self.rewards.submit(chunk.groups, chunk.rollout_id)
            lost = self.generators.lost()
            self._note_generated([h for h in ready if h not in lost])
            # A peer that died fails its handle at once; the others may never finish (ranks
            # blocked in a collective with the dead one).
            self.futures.get([h for h in ready if h in waiting and h not in chunks | lost])
            waiting.difference_update(ready)
            if self.generators.lost() and self._learner_between_steps:
                self._heal_engines()
        return handles

    def _note_generated(self, ready: list[Handle]) -> None:
        now = time.monotonic()
        for rollout in list(self._generating.values()):
            rollout.pending.difference_update(ready)
            if not rollout.pending:
                rollout.generated = now
                del self._generating[rollout.id]

    # ----- checkpoints --------------------------------------------------------------------------
    def _checkpoint_due(self, step: int) -> bool:
        every = self.cfg.trainer.checkpoint_every
        return self.checkpointing is not None and every > 0 and step % every == 0

    def _running_totals(self) -> dict[str, float]:
        before = self._totals_before
        return {
            "reward_errors": before["reward_errors"] + self.rewards.errors,
            "reward_timeouts": before["reward_timeouts"] + self.rewards.timeouts,
        }

    def _save_checkpoint(self, step: int, ahead: deque[Rollout]) -> None:
        """Save the state after `step`: the ranks write their shards while the engines
        generate the next step's rollout (launched first when none is ahead yet)."""
        started = time.monotonic()
        trainer, ckpt = self.cfg.trainer, self.checkpointing
        if not ahead and step < trainer.steps:
            ahead.append(self._launch())
        staging = ckpt.store.staging(step)
        try:
            self.futures.get(
                self._stream_until(self.learner.async_save_checkpoint(str(staging / LEARNER_DIR)))
            )
        except PeerDied as err:
            raise LearnerLost(f"a learner rank died in a checkpoint save: {err}") from err
        if trainer.save_hf_every and step % trainer.save_hf_every == 0:
            self.learner.save_pretrained(str(staging / HF_DIR))
            ckpt.add_tokenizer(staging / HF_DIR)
        state = DriverState(
            step=step,
            policy_version=self.version,
            # Rollouts ahead were drawn for later steps: a resume draws them again.
            prompts_consumed=ahead[0].first_prompt if ahead else self._prompts_taken,
            warm_start_accuracy=self.warm_accuracy,
            counters=self._running_totals() | self._restart_totals(),
            model_config_json=ckpt.model_config_json,
            num_ranks=self.learner.num_ranks,
        )
        ckpt.store.commit(staging, state, self.cfg.dump_yaml(), trainer.keep_checkpoints)
        self._saved_at = time.monotonic()
        self._last_save = self._saved_at - started

    def restore(self, checkpoint: Path, state: DriverState) -> None:
        """Continue where `checkpoint` left off: the learner's shards, the engines on its
        policy version, the prompt stream at its position."""
        self.learner.load_checkpoint(str(checkpoint / LEARNER_DIR))
        self.version = state.policy_version
        self._learner_between_steps = True
        self._sync_engines(stream=False)
        self.first_step = state.step + 1
        self.warm_accuracy = state.warm_start_accuracy
        self.prompts = islice(
            self.task.train_prompts(self.cfg.trainer.seed), state.prompts_consumed, None
        )
        self._prompts_taken = state.prompts_consumed
        self._totals_before = {k: state.counters.get(k, 0.0) for k in self._totals_before}
        # Restarts only add up, also over a rebuild from an older checkpoint; the pool's own
        # count, which the checkpoint may include, goes on.
        self.learner_restarts = max(
            self.learner_restarts, int(state.counters.get("learner_restarts", 0))
        )
        saved = int(state.counters.get("engine_restarts", 0))
        self._engine_restarts_before = max(
            self._engine_restarts_before, saved - self.generators.restarts
        )

    def recover_learner(self, checkpoint: Path, state: DriverState) -> None:
        """After LearnerLost: new ranks, and the whole job back at `checkpoint` (the steps
        after it are trained again). The rollouts in flight are let finish and dropped."""
        self._learner_between_steps = False  # no weights to send before the ranks are back
        while self.generators.in_flight():
            self._stream_until(self.generators.in_flight())
        for rollout_id in self._undrained:
            self.rewards.drain(rollout_id)
        self._undrained.clear()
        self._generating.clear()
        self.generators.drop_lost()
        self.learner.restart()
        self.learner_restarts += 1
        self.restore(checkpoint, state)

    def _restart_totals(self) -> dict[str, float]:
        return {
            "engine_restarts": self._engine_restarts_before + self.generators.restarts,
            "learner_restarts": self.learner_restarts,
        }

    # ----- evaluation and monitoring ------------------------------------------------------------
    def evaluate(self) -> dict[str, float | dict[str, float]]:
        """Held-out scores (blocking) of the job's own held-out set (eval_*) and of each
        `task.eval_sets` set (eval_set_*, by name)."""
        scores = self._held_out_scores(self.eval_set, self._pool_rewards)
        out = {f"eval_{key}": value for key, value in scores.items()}
        for held_out in self.held_out_sets:
            for key, value in self._held_out_scores(held_out.prompts, held_out.rewards).items():
                out.setdefault(f"eval_set_{key}", {})[held_out.name] = value
        return out

    def _held_out_scores(
        self, prompts: list[Prompt], score: Callable[[list[SampledGroup]], list[list[float]]]
    ) -> dict[str, float]:
        """accuracy (greedy), and with `trainer.eval_samples` = n also mean_at_n and
        pass_at_k of n sampled answers per prompt."""
        trainer = self.cfg.trainer
        scores = {"accuracy": greedy_share(score(self._answers(prompts, greedy=True)))}
        if trainer.eval_samples:
            k = trainer.eval_pass_k or trainer.eval_samples
            rewards = score(self._answers(prompts, greedy=False))
            scores["mean_at_n"], scores["pass_at_k"] = sampled_scores(rewards, k)
        return scores

    def _answers(self, prompts: list[Prompt], greedy: bool) -> list[SampledGroup]:
        while True:
            if self.generators.needs_weights():
                self._heal_engines()
            try:
                return self.generators.complete(
                    prompts, self.cfg.trainer.eval_samples, self.cfg.rollout.sampling, greedy
                )
            except PeerDied:
                if not self.generators.replace_dead():
                    raise

    def _pool_rewards(self, groups: list[SampledGroup]) -> list[list[float]]:
        """The reward workers score the job's own held-out answers, as in training: a hostile
        answer cannot stall the driver."""
        self.rewards.submit(groups, EVAL_ROLLOUT)
        return [sg.rewards for sg in self.rewards.drain(EVAL_ROLLOUT)]

    def _export_queues(self) -> None:
        if self.exporter is not None:
            self.exporter.set_queue_depth("generation", self.generators.queued_prompts())
            self.exporter.set_queue_depth("reward", self.rewards.pending_groups())
            self.exporter.set_cluster(
                self.generators.num_engines, self.rewards.num_workers, self.learner.num_ranks
            )

    def _export(self, record: dict) -> None:
        if self.exporter is not None:
            self.exporter.observe_step(record)
            self._export_queues()

    def shutdown(self) -> None:
        """Stop the job's actors (on a shared cluster nothing else would) and scorers."""
        self.learner.shutdown()
        self.generators.shutdown()
        self.rewards.shutdown()
        for held_out in self.held_out_sets:
            held_out.close()
