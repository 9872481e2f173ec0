"""The job loop: one training job as a pipeline over four peers.

prompts -> generator pool (chunks, handed on as each finishes) -> reward pool -> advantages
-> learner -> weight transport -> engines.

The prompt stream is cut into chunks, one engine call each, taken by the learner in the order
they were drawn: a step trains the next `rollout.prompts_per_step` groups of the stream as soon
as they are scored, whichever rollouts they were drawn for. The engines keep at most
CHUNKS_PER_ENGINE chunks each (actors/generator.py), the rest wait here, so a weight load sent
to an engine runs after at most that many chunks: weights reach each engine between chunks,
and no engine waits for another's load.

Staleness: with `trainer.max_staleness` = k, the prompts of the next k steps may be drawn and
generating while a step trains (`_limit`). A group drawn while the learner is at version v is
sampled by version v or later and trained by version v + k at the latest: never more than k
versions old. k = 0 is strictly on-policy. A group older than k (a refill's surplus at k = 0,
or a chunk of an engine that failed to load) is dropped and counted, never trained on. Dynamic
sampling (DAPO) skips groups whose rewards are all equal and draws new prompts for them, a
whole chunk at a time, up to MAX_REFILLS steps' worth.

The loop blocks in three places, each a stage of the step record: the next group's generation
(`wait_rollout`) and then its scores (`reward`), the learner's step (`learn`) and the learner's
side of the weight sync (`sync`); the engines load the weights on their own. Whatever it waits
on, every chunk that finishes meanwhile goes to the reward pool at once and every engine with
room takes the next chunk, so generation and scoring overlap learning.

Checkpoints (`trainer.checkpoint_every`): after a step's record is written, the ranks save
their shards while the engines already generate; the driver's state says where the prompt
stream stood, so a resumed job (`restore`) trains the same prompts in the same order.

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

from groupflow.actors.generator import chunk_size
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
from groupflow.scaling import Scaler
from groupflow.sequences import group_advantages, train_sequences
from groupflow.timing import stage_timer, time_keys
from groupflow.unscored import UnscoredSteps

# Dynamic sampling looks at most this many steps' worth of extra groups per step (DAPO keeps
# drawing; a bound keeps a task that is all-solved or all-failed from stalling the job).
MAX_REFILLS = 3

EVAL_ROLLOUT = -1  # the reward pool's batch id for held-out answers (chunks count from 0)


class LearnerLost(RuntimeError):
    """A learner rank died: the ranks must be rebuilt from a checkpoint."""


class StepSink(Protocol):
    def write(self, record: dict) -> None: ...


@dataclass
class Chunk:
    """Prompts of the stream, at positions [first, first + len(prompts)), sampled in one
    engine call; its groups are scored under its id."""

    id: int
    first: int
    prompts: list[Prompt]
    handle: Handle | None = None  # None: waiting for an engine with room
    sent: float = 0.0
    generated: float | None = None  # when it was handed to the reward pool
    scored: list[ScoredGroup] | None = None  # once drained from the reward pool


@dataclass
class StepGroups:
    """What a step takes from the stream."""

    groups: list[ScoredGroup] = field(default_factory=list)
    dropped_stale: int = 0  # groups older than max_staleness, never trained on
    filtered: int = 0  # groups dynamic sampling skipped (all rewards equal)
    first_sent: float | None = None  # the span of the chunks its groups came from
    last_generated: float = 0.0

    @property
    def generation_s(self) -> float:
        return 0.0 if self.first_sent is None else self.last_generated - self.first_sent


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
        scaler: Scaler | None = None,
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
        self.scaler = scaler  # resizes the pools between steps (groupflow/scaling.py)
        self.unscored = UnscoredSteps(cfg.reward.max_unscored_steps)
        self.prompts = task.train_prompts(cfg.trainer.seed)
        self.eval_set = task.eval_prompts(cfg.task.eval_size)
        self.version = 0
        self.first_step = 1
        self.warm_accuracy: float | None = None
        # The stream: positions of the prompt stream drawn so far, consumed so far (trained,
        # skipped or dropped), and the most that may be drawn now (see the module's doc).
        self._drawn = 0
        self._consumed = 0
        self._limit = 0
        self._chunk_ids = 0
        self._chunks: deque[Chunk] = deque()  # drawn and not yet consumed, in stream order
        self._front: deque[ScoredGroup] = deque()  # scored groups of a consumed chunk
        self._engine_loads: list[Handle] = []  # weight loads the engines have not finished
        self._refilling = False  # dynamic sampling is drawing prompts for skipped groups
        self.dropped_stale = 0
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
        for step in range(self.first_step, self.cfg.trainer.steps + 1):
            record = self._step(step)
            if self.scaler is not None:  # the pools change only here, between steps
                record.update(self.scaler.between_steps(record))
            for sink in sinks:
                sink.write(record)
            self._export(record)
            self._engine_restarts_at_step = self.generators.restarts
            if self._checkpoint_due(step):
                self._save_checkpoint(step)

    def _step(self, step: int) -> dict:
        started, times = time.monotonic(), {}
        idle_before = self.generators.idle_engine_seconds()
        taken = self._take_groups(step, times)
        while not self.unscored.trainable(taken.groups):  # never train on nothing
            taken = self._take_groups(step, times)
        self._export_queues()
        advantages = group_advantages(taken.groups, self.cfg)
        if self.sample_log is not None:
            self.sample_log(step, taken.groups, advantages)
        seqs = train_sequences(taken.groups, advantages, self.cfg.algorithm)
        staleness = [self.version - s.policy_version for s in seqs]
        steps = self.cfg.trainer.steps
        lr = lr_at(self.cfg.learner.optimizer, step, steps)
        results = self._learn(seqs, times, lr)
        times["gen"] = taken.generation_s
        with stage_timer("metrics", times):
            record = {"step": step, "policy_version": self.version, "lr": lr}
            record.update(rollout_record(taken.groups, staleness, times))
            record.update(self.learner_figures(results))
            record["groups_dropped_stale"] = taken.dropped_stale
            record["groups_filtered"] = taken.filtered
        record.update(self._running_totals() | self._restart_totals())
        if self.checkpointing is not None:
            record["seconds_since_checkpoint"] = time.monotonic() - self._saved_at
            if self._last_save is not None:
                record["checkpoint_seconds"] = self._last_save
        every = self.cfg.trainer.eval_every
        if every and step % every == 0 and step < steps:  # the run's own evaluation ends it
            record.update(self.evaluate())
        times["step"] = time.monotonic() - started
        idle = self.generators.idle_engine_seconds() - idle_before
        times["engines_idle"] = idle / max(1, self.generators.num_engines)
        record.update(time_keys(times))
        return record

    def _take_groups(self, step: int, times: dict[str, float]) -> StepGroups:
        """The step's groups: the next ones of the stream, in order, as soon as each is scored.
        Groups too old are dropped; with dynamic sampling, groups that teach nothing are
        skipped, each replaced by a new prompt, until MAX_REFILLS steps' worth were looked at
        (then the step trains on what it has, or on the first skipped groups if nothing)."""
        per_step, k = self.cfg.rollout.prompts_per_step, self.cfg.trainer.max_staleness
        dynamic = self.cfg.algorithm.dynamic_sampling
        budget = (1 + MAX_REFILLS) * per_step if dynamic else per_step
        taken, skipped, looked_at = StepGroups(), [], 0
        self._refilling = False
        # What may still be drawn for later steps: the next k steps' prompts, but none for a
        # step after the last.
        ahead = min(k, self.cfg.trainer.steps - step) * per_step
        while (needed := min(per_step - len(taken.groups), budget - looked_at)) > 0:
            self._limit = self._consumed + needed + ahead
            group = self._next_group(taken, times)
            if self.version - group.group.policy_version > k:
                taken.dropped_stale += 1
                self.dropped_stale += 1
                if taken.dropped_stale > budget:
                    raise RuntimeError(
                        f"{taken.dropped_stale} groups in a row were older than "
                        f"trainer.max_staleness={k}: the engines do not load new weights"
                    )
                continue
            looked_at += 1
            if dynamic and len(set(group.rewards)) == 1:
                taken.filtered += 1
                skipped.append(group)
                self._refilling = True
            else:
                taken.groups.append(group)
        if not taken.groups:
            taken.groups = skipped[:per_step]
        self._refilling = False
        self._limit = self._consumed + ahead
        self._feed()
        return taken

    def _next_group(self, taken: StepGroups, times: dict[str, float]) -> ScoredGroup:
        """The stream's next scored group (blocking). The wait for its chunk's generation is
        `wait_rollout`: the learner idle for want of samples."""
        if not self._front:
            self._feed()
            chunk = self._chunks[0]
            with stage_timer("wait_rollout", times):
                while chunk.generated is None:  # a chunk lost with its engine is sent again
                    self._pump(())
            with stage_timer("reward", times):
                self._front.extend(self.rewards.drain(chunk.id))
            self._chunks.popleft()
            if taken.first_sent is None or chunk.sent < taken.first_sent:
                taken.first_sent = chunk.sent
            taken.last_generated = max(taken.last_generated, chunk.generated)
        self._consumed += 1
        return self._front.popleft()

    def _learn(self, seqs: list[TrainSequence], times: dict[str, float], lr: float) -> list:
        """One learner step, then the new version sent to the engines; the ranks' results."""
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
        with stage_timer("sync", times):
            self._sync_engines(wait_for_engines=False)
        return results

    def _sync_engines(self, wait_for_engines: bool, only_awaiting: bool = False) -> None:
        """Send every engine (or, `only_awaiting`, those that await the weights) the learner's
        current version (it must be between steps) and wait for the learner's side; each
        engine loads it after the chunks it holds, on its own (or waited for too, with
        `wait_for_engines`). A dead engine met on the way is replaced and the sync sent
        again."""
        while True:
            restarts = self.generators.restarts
            engines = self.generators.awaiting_weights() if only_awaiting else None
            handles = self.transport.async_sync(self.version, engines)
            self._resend_lost(self.generators.weights_sent())
            if wait_for_engines:
                wait = handles.learner + handles.engines
            else:  # an engine that dies loading is noticed in `_pump`
                wait = handles.learner
                self._engine_loads.extend(handles.engines)
            try:
                self.futures.get(self._stream_until(wait))
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
            self._sync_engines(wait_for_engines=True, only_awaiting=True)
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
        for chunk in self._chunks:
            if chunk.handle in resent:
                chunk.handle = resent[chunk.handle]

    # ----- the stream ---------------------------------------------------------------------------
    def _feed(self) -> None:
        """Draw prompts up to `_limit` into chunks, and send waiting chunks to the engines
        with room (a replaced engine gets the weights first, if the learner can send them)."""
        if self.generators.needs_weights() and self._learner_between_steps:
            self._heal_engines()
        size = chunk_size(self.cfg.rollout.prompts_per_step, self.generators.num_engines)
        waiting = [c for c in self._chunks if c.handle is None]
        # A short chunk only when no full one waits. A refill draws a whole chunk, so that a
        # task with many flat groups is refilled in few rounds of generation, not a round per
        # group; what the step then does not need goes to the next steps (at staleness 0 it
        # is too old by then, and dropped).
        while (count := min(size, self._limit - self._drawn)) > 0 and (
            count == size or not waiting
        ):
            if self._refilling:
                count = size
            prompts = list(islice(self.prompts, count))
            chunk = Chunk(self._chunk_ids, self._drawn, prompts)
            self._chunk_ids += 1
            self._drawn += count
            self._chunks.append(chunk)
            waiting.append(chunk)
        for chunk in waiting[: self.generators.room()]:
            chunk.handle = self.generators.send(chunk.prompts, chunk.id)
            chunk.sent = time.monotonic()

    def _stream_until(self, handles: Sequence[Handle]) -> Sequence[Handle]:
        """Block until every one of `handles` is ready, streaming chunks meanwhile (`_pump`).
        Returns `handles`."""
        waiting = set(handles)
        while waiting:
            waiting.difference_update(self._pump(waiting))
        return handles

    def _pump(self, waiting: set[Handle] | tuple) -> list[Handle]:
        """Wait for any of `waiting`, a chunk or an engine's weight load; hand finished chunks
        to the reward pool and send engines with room their next chunk. Returns the ready
        ones among `waiting` (raising where such a handle's peer failed)."""
        chunks = set(self.generators.in_flight())
        loads = set(self._engine_loads)
        ready = self.futures.wait_any(list(set(waiting) | chunks | loads))
        by_handle = {c.handle: c for c in self._chunks if c.handle is not None}
        now = time.monotonic()
        for generated in self.generators.take(ready):
            self.rewards.submit(generated.groups, generated.chunk_id)
        lost = self.generators.lost()
        for handle in ready:
            if handle in by_handle and handle not in lost and handle in chunks:
                by_handle[handle].generated = now
        self._note_loads([h for h in ready if h in loads])
        # A peer that died fails its handle at once; the others may never finish (ranks
        # blocked in a collective with the dead one).
        self.futures.get([h for h in ready if h in waiting and h not in chunks | lost | loads])
        if (lost or self.generators.needs_weights()) and self._learner_between_steps:
            self._heal_engines()
        self._feed()
        return [h for h in ready if h in waiting]

    def _note_loads(self, done: list[Handle]) -> None:
        """Weight loads that finished; an engine that died loading is replaced (its chunks
        are lost and sent again once the replacement has the weights)."""
        for handle in done:
            self._engine_loads.remove(handle)
            try:
                self.futures.get([handle])
            except PeerDied:
                self.generators.replace_dead()
                self._check_restarts()

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

    def _save_checkpoint(self, step: int) -> None:
        """Save the state after `step`: the ranks write their shards while the engines
        generate the next step's prompts (drawn first, at staleness 0)."""
        started = time.monotonic()
        trainer, ckpt = self.cfg.trainer, self.checkpointing
        if step < trainer.steps:
            self._limit = max(self._limit, self._consumed + self.cfg.rollout.prompts_per_step)
            self._feed()
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
            # Prompts drawn for later steps are drawn again by a resume.
            prompts_consumed=self._consumed,
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
        self._sync_engines(wait_for_engines=True)
        self.first_step = state.step + 1
        self.warm_accuracy = state.warm_start_accuracy
        self.prompts = islice(
            self.task.train_prompts(self.cfg.trainer.seed), state.prompts_consumed, None
        )
        self._drawn = self._consumed = self._limit = state.prompts_consumed
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
        self._limit = self._drawn  # nothing more is drawn or sent
        self._chunks = deque(c for c in self._chunks if c.handle is not None)
        while self.generators.in_flight():
            self._stream_until(self.generators.in_flight())
        for chunk in self._chunks:
            if chunk.generated is not None:
                self.rewards.drain(chunk.id)
        self._chunks.clear()
        self._front.clear()
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
