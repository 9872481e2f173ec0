"""A pool of reward-worker actors, sized independently of the engines.

Groups are scored in batches as they arrive (so scoring overlaps generation and learning),
each batch tagged with its chunk id. A worker is sent only each response's prompt and text
and returns their verdicts; the pool keeps the batch's groups and pairs them up again. The
pool is reached like the generator pool, through the job's futures (groupflow.core.peers.Futures):
the job loop waits on the batches `in_flight` with everything else, in its one wait, at most
until `seconds_to_deadline`, and hands what is ready to `take`. A worker scores a batch
within `reward.timeout_s` (its scorer processes are killed at each call's deadline, and
responses still unscored when the budget runs out are timeouts), so the driver never waits on
a stuck verifier longer than that. A worker that gives no answer within that plus a grace
period is replaced and its batch scored 0; a worker that dies is replaced and its batch
retried up to `reward.max_retries` times. Its slot takes no batch until the replacement is up
(actors/starting.py Replacements): the other workers score meanwhile, and with none left the
batches wait for the first replacement that comes up.

Scaling (groupflow scale): `scale_to` starts or retires workers and returns at once; `settle`,
between steps, admits the workers that are up and removes retired ones once their batches
are scored (a retiring worker takes no new batch, so nothing is scored twice or lost).

Ray reaches the pool only through what `start_reward_pool` hands it (the futures, the worker
starter, the replacements' starts and ends) and its clock times the deadlines, so its unit
tests run it over fake workers on a virtual clock (tests/unit/test_reward_pool.py).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import ray

from groupflow.actors.futures import RayFutures
from groupflow.actors.starting import ActorSlots, Replacements, StartingActors
from groupflow.config import Config
from groupflow.core.peers import Futures, Handle, PeerDied
from groupflow.core.records import SampledGroup, ScoredGroup, Verdict
from groupflow.core.scaling_protocol import PoolState, ray_demand
from groupflow.core.start_errors import StartError
from groupflow.core.threads import thread_env
from groupflow.reward_workers.scorer import ResponseItem, Scorer, response_items, scored_groups

log = logging.getLogger(__name__)


# Beyond reward.timeout_s, what a worker may take to answer before it counts as hung: the
# last call's deadline margin and the Ray round trip.
_GRACE_S = 5.0
# Replacements that fail to start in a row (a verifier plugin that does not import on a node)
# before the job stops with the last one's error.
MAX_FAILED_STARTS = 3


class RewardWorker:
    def __init__(
        self,
        task_name: str,
        task_options: dict,
        plugin: str | None,
        plugin_timeout_s: float,
        processes: int = 1,
    ):
        self.scorer = Scorer(
            task_name, task_options, plugin=plugin, timeout_s=plugin_timeout_s, processes=processes
        )

    def score(
        self, items: list[ResponseItem], deadline_unix: float
    ) -> tuple[list[Verdict], int, int]:
        """A verdict for each (prompt, response text), in order, and the errors and timeouts
        among them. deadline_unix: wall-clock time when the pool submitted the batch plus
        reward.timeout_s, so that time spent queued behind other batches counts too."""
        before = (self.scorer.errors, self.scorer.timeouts)
        budget_s = max(0.0, deadline_unix - time.time())
        verdicts = list(self.scorer.score_stream(items, budget_s))
        return verdicts, self.scorer.errors - before[0], self.scorer.timeouts - before[1]


@dataclass
class _Batch:
    chunk_id: int
    groups: list[SampledGroup]
    worker: int
    actor: object  # the worker it was sent to (its slot may hold a replacement since)
    ref: Handle
    started: float  # on the pool's clock
    attempts: int = 1


class RewardPool:
    """The reward workers as one pool (groupflow.core.peers.Scoring)."""

    def __init__(
        self,
        workers: list,
        futures: Futures,
        timeout_s: float,
        max_retries: int,
        start_worker: Callable[[], object],
        starting: StartingActors | None = None,
        replacements: Replacements | None = None,
        demand: Mapping[str, float] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`timeout_s` and `max_retries` are reward.timeout_s and reward.max_retries;
        `start_worker` makes a new worker (a replacement, a scale-up). `starting` and
        `replacements` stand in for Ray's in unit tests, as the generator pool's do (a worker
        is ended through `replacements`); `demand` is one worker's Ray resources (said when a
        replacement waits for room); `clock` times the batches' deadlines."""
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self._start = start_worker
        self.workers = workers
        self._load = [0] * len(self.workers)
        self._pending: list[_Batch] = []
        # (chunk id, groups, attempts) of batches that wait for a worker: every one was lost
        self._queued: list[tuple[int, list[SampledGroup], int]] = []
        self._failed_starts = 0  # in a row
        self.errors = 0
        self.timeouts = 0
        self.futures = futures
        self._clock = clock
        if starting is None:
            starting = StartingActors("reward worker")
        if replacements is None:
            replacements = Replacements(
                "reward worker", lambda w: w.__ray_ready__.remote(), futures, demand or {}
            )
        # Retiring and vacant slots are given no new batch.
        self.slots = ActorSlots(self.workers, starting, replacements)

    def _deadline_s(self, batch: _Batch) -> float:
        """The worker ends every batch within reward.timeout_s; one past that (and a grace
        period) has a hung or lost worker."""
        return self.timeout_s + _GRACE_S

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def submit(self, groups: list[SampledGroup], chunk_id: int) -> None:
        """Queue groups for scoring on the least-loaded worker."""
        if groups:
            self._launch(chunk_id, groups, attempts=1)

    def _launch(self, chunk_id: int, groups: list[SampledGroup], attempts: int) -> None:
        """Send a batch to the least-loaded worker, or queue it while there is none."""
        idle = self.slots.idle()
        taking = [w for w in range(len(self.workers)) if w not in idle]
        if not taking:
            self._queued.append((chunk_id, groups, attempts))
            return
        worker = min(taking, key=self._load.__getitem__)
        self._load[worker] += len(groups)
        actor = self.workers[worker]
        # The worker gets what its verifier reads; the groups stay here (scored_groups).
        ref = actor.score.remote(response_items(groups), time.time() + self.timeout_s)
        self._pending.append(_Batch(chunk_id, groups, worker, actor, ref, self._clock(), attempts))

    def _replace(self, batch: _Batch, why: str) -> None:
        """Replace the batch's worker, unless another failed batch already did (a retiring one
        is only ended: it was leaving)."""
        slot = batch.worker
        if self.workers[slot] is not batch.actor or slot in self.slots.vacant():
            return
        self.slots.replacements.end(batch.actor)
        if slot in self.slots.retiring:
            return
        self.slots.replacements.ask(slot, self._start)
        self._load[slot] = 0
        left = len(self.workers) - len(self.slots.idle())
        log.warning(
            "reward worker %d %s; a replacement is asked for; %s",
            slot,
            why,
            f"scoring goes on with {left} worker(s)" if left else "batches wait for it",
        )

    def _admit_replacements(self, ready: Sequence[Handle]) -> None:
        up, failed = self.slots.replacements.take(ready)
        for slot, worker in up:
            self.slots.fill(slot, worker)
            self._failed_starts = 0
        for slot, why in failed:
            self._failed_starts += 1
            if self._failed_starts >= MAX_FAILED_STARTS:
                raise StartError(why)
            log.warning("%s; asking for another", why)
            self.slots.replacements.ask(slot, self._start)
        if up and self._queued:
            queued, self._queued = self._queued, []
            for chunk_id, groups, attempts in queued:
                self._launch(chunk_id, groups, attempts)

    def _retry_or_zero(self, batch: _Batch, why: str) -> list[ScoredGroup]:
        if batch.attempts <= self.max_retries:
            log.warning(
                "reward batch %s on worker %d; retrying (attempt %d)",
                why,
                batch.worker,
                batch.attempts + 1,
            )
            self._launch(batch.chunk_id, batch.groups, batch.attempts + 1)
            return []
        log.error("reward batch %s after %d attempts; scoring it 0", why, batch.attempts)
        return self._zero(batch, why)

    def _zero(self, batch: _Batch, why: str) -> list[ScoredGroup]:
        self.timeouts += sum(len(g.responses) for g in batch.groups)
        return [
            ScoredGroup(
                g, [Verdict(0.0, f"reward worker {why}", error="timeout")] * len(g.responses)
            )
            for g in batch.groups
        ]

    def in_flight(self) -> list[Handle]:
        return [b.ref for b in self._pending] + self.slots.replacements.handles()

    def seconds_to_deadline(self) -> float | None:
        if not self._pending:
            return None
        first = min(b.started + self._deadline_s(b) for b in self._pending)
        return max(0.0, first - self._clock())

    def scoring(self, chunk_id: int) -> bool:
        return any(b.chunk_id == chunk_id for b in self._pending) or any(
            q[0] == chunk_id for q in self._queued
        )

    def take(self, ready: Sequence[Handle]) -> list[tuple[int, list[ScoredGroup]]]:
        """The groups of the batches among `ready`, and of the overdue ones (scored 0), by
        chunk id; a batch whose worker died is sent again instead (up to max_retries)."""
        self._admit_replacements(ready)
        ready, now = set(ready), self._clock()
        taken = []
        for batch in list(self._pending):
            finished = batch.ref in ready
            if not finished and now - batch.started < self._deadline_s(batch):
                continue
            self._pending.remove(batch)
            if self.workers[batch.worker] is batch.actor:
                self._load[batch.worker] -= len(batch.groups)
            taken.append((batch.chunk_id, self._result(batch, finished)))
        return taken

    def _result(self, batch: _Batch, finished: bool) -> list[ScoredGroup]:
        if not finished:  # overdue; not retried: that would stall the step again
            self._replace(batch, "gave no answer in time (hung or lost)")
            return self._zero(batch, "timed out")
        try:
            ((verdicts, errors, timeouts),) = self.futures.get([batch.ref])
        except PeerDied as err:
            self._replace(batch, f"died ({err})")
            return self._retry_or_zero(batch, "lost its worker")
        self.errors += errors
        self.timeouts += timeouts
        return scored_groups(batch.groups, verdicts)

    def wait_all(self) -> dict[int, list[ScoredGroup]]:
        """Block until every batch is scored; the groups by chunk id, in completion order.
        For a caller without a job loop (a benchmark, a test of the pool)."""
        done: dict[int, list[ScoredGroup]] = defaultdict(list)
        while self._pending or self._queued:
            ready = self.futures.wait_any(self.in_flight(), self.seconds_to_deadline())
            for chunk_id, groups in self.take(ready):
                done[chunk_id] += groups
        return done

    def pending_groups(self) -> int:
        return sum(len(b.groups) for b in self._pending) + sum(len(q[1]) for q in self._queued)

    # ----- scaling (between steps) --------------------------------------------------------------
    def scale_to(self, target: int) -> None:
        if target < 1:
            raise ValueError(f"a pool needs at least one reward worker (got {target})")
        self.slots.scale_to(target, self._start)

    def settle(self) -> PoolState:
        joined = len(self.slots.admit())
        self._load += [0] * joined
        drained = self.slots.drained({b.worker for b in self._pending})
        for slot in drained:
            worker = self.slots.remove(slot)
            del self._load[slot]
            for batch in self._pending:
                if batch.worker > slot:
                    batch.worker -= 1
            self.slots.replacements.end(worker)
        return self.slots.state(joined, len(drained))

    def state(self) -> PoolState:
        return self.slots.state()

    def shutdown(self) -> None:
        self.slots.starting.shutdown()
        self.slots.replacements.shutdown()
        for worker in self.workers:
            self.slots.replacements.end(worker)


def start_reward_pool(cfg: Config) -> RewardPool:
    """`reward.num_workers` reward-worker actors, each placed by its declared resources; a
    dead one is replaced by a new actor with the same settings."""
    res = cfg.reward.resources
    actor = ray.remote(RewardWorker).options(
        num_cpus=res.num_cpus,
        num_gpus=res.num_gpus,
        resources=res.custom,
        runtime_env={"env_vars": thread_env(res.threads)},  # its scorer processes' too
    )
    args = (
        cfg.task.name,
        cfg.task.options,
        cfg.reward.verifier,
        cfg.reward.plugin_timeout_s,
        cfg.reward.scorer_processes,
    )

    def start_worker():
        return actor.remote(*args)

    return RewardPool(
        [start_worker() for _ in range(cfg.reward.num_workers)],
        RayFutures(),
        cfg.reward.timeout_s,
        cfg.reward.max_retries,
        start_worker,
        demand=ray_demand(res.num_cpus, res.num_gpus, res.custom),
    )
