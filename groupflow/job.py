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
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Protocol

from groupflow.config import Config
from groupflow.evaluate import greedy_accuracy
from groupflow.learner.figures import learner_record
from groupflow.peers import Futures, Generation, Handle, Learner, Scoring, WeightSync
from groupflow.prometheus import PrometheusExporter
from groupflow.records import ScoredGroup, TrainSequence
from groupflow.reward_workers.tasks.base import Task
from groupflow.rollout_figures import rollout_record
from groupflow.sequences import train_sequences
from groupflow.timing import stage_timer, time_keys

# Dynamic sampling draws at most this many extra rollouts per step (DAPO keeps drawing; a
# bound keeps a task that is all-solved or all-failed from stalling the job).
MAX_REFILLS = 3


class StepSink(Protocol):
    def write(self, record: dict) -> None: ...


@dataclass
class Rollout:
    """One rollout's prompts in generation."""

    id: int
    started: float
    pending: set[Handle] = field(default_factory=set)  # chunks not yet handed on
    generated: float | None = None  # when its last chunk was handed on

    @property
    def generation_s(self) -> float:
        return (self.generated or self.started) - self.started


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
        self.prompts = task.train_prompts(cfg.trainer.seed)
        self.eval_set = task.eval_prompts(cfg.task.eval_size)
        self.version = 0
        self._rollout_ids = 0
        self._generating: dict[int, Rollout] = {}

    # ----- the steps ----------------------------------------------------------------------------
    def train(self, sinks: Sequence[StepSink]) -> None:
        """Run the steps; each step record goes to every sink (metrics.jsonl, progress)."""
        ahead: deque[Rollout] = deque()  # rollouts of the steps after the current one
        for step in range(1, self.cfg.trainer.steps + 1):
            record = self._step(step, ahead)
            for sink in sinks:
                sink.write(record)
            self._export(record)

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
        seqs = train_sequences(scored, self.cfg.algorithm)
        staleness = [self.version - s.policy_version for s in seqs]
        if max(staleness, default=0) > k:
            raise RuntimeError(
                f"a sample {max(staleness)} versions old exceeds trainer.max_staleness={k}"
            )
        results = self._learn(seqs, times)
        times["gen"] = rollout.generation_s
        with stage_timer("metrics", times):
            record = {"step": step, "policy_version": self.version}
            record.update(rollout_record(scored, staleness, times))
            record.update(self.learner_figures(results))
        record.update(reward_errors=self.rewards.errors, reward_timeouts=self.rewards.timeouts)
        every = self.cfg.trainer.eval_every
        if every and step % every == 0 and step < steps:  # the run's own evaluation ends it
            record["eval_accuracy"] = self.evaluate()
        times["step"] = time.monotonic() - started
        record.update(time_keys(times))
        return record

    def _learn(self, seqs: list[TrainSequence], times: dict[str, float]) -> list:
        """One learner step, then the engines on the new version; the ranks' results."""
        with stage_timer("learn", times):
            results = self.futures.get(self._stream_until(self.learner.async_train_step(seqs)))
        self.version += 1
        # An engine loads weights only after the chunks already sent to it: wait for those
        # first, so that the sync's time is its own.
        with stage_timer("wait_gen", times):
            self._stream_until(self.generators.in_flight())
        with stage_timer("sync", times):
            self.futures.get(self._stream_until(self.transport.async_sync(self.version)))
        return results

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
        prompts = list(islice(self.prompts, self.cfg.rollout.prompts_per_step))
        rollout = Rollout(self._rollout_ids, time.monotonic())
        self._rollout_ids += 1
        rollout.pending = set(self.generators.submit(prompts, rollout.id))
        if rollout.pending:
            self._generating[rollout.id] = rollout
        else:
            rollout.generated = rollout.started
        return rollout

    def _finish(self, rollout: Rollout, times: dict[str, float]) -> list[ScoredGroup]:
        """Block until the rollout is generated, then until it is scored."""
        self._stream_until(rollout.pending)
        with stage_timer("reward", times):
            return self.rewards.drain(rollout.id)

    def _stream_until(self, handles: Sequence[Handle]) -> Sequence[Handle]:
        """Block until every one of `handles` is ready, handing each generation chunk that
        finishes meanwhile to the reward pool at once. Returns `handles`."""
        waiting = set(handles)
        while waiting:
            ready = self.futures.wait_any(list(waiting | set(self.generators.in_flight())))
            for chunk in self.generators.take(ready):
                self.rewards.submit(chunk.groups, chunk.rollout_id)
            self._note_generated(ready)
            waiting.difference_update(ready)
        return handles

    def _note_generated(self, ready: list[Handle]) -> None:
        now = time.monotonic()
        for rollout in list(self._generating.values()):
            rollout.pending.difference_update(ready)
            if not rollout.pending:
                rollout.generated = now
                del self._generating[rollout.id]

    # ----- evaluation and monitoring ------------------------------------------------------------
    def evaluate(self) -> float:
        """Greedy accuracy on the held-out set (blocking; the engines split it)."""
        texts = self.generators.greedy(self.eval_set, self.cfg.rollout.sampling.max_tokens)
        return greedy_accuracy(self.task, self.eval_set, texts)

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
        """Stop the job's actors; on a shared cluster nothing else would."""
        self.learner.shutdown()
        self.generators.shutdown()
        self.rewards.shutdown()
