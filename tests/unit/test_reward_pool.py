"""The reward pool (actors/reward.py RewardPool) over fake workers on a virtual clock: a hung
worker's batch is scored 0 at its deadline, a dead worker's batch is retried within
reward.max_retries and its slot refilled, and replacements that keep failing to start stop
the job. The futures are tests/unit/job_loop_fakes.py's: waiting moves the clock to the first
handle ready or to the timeout, as a cluster would."""

from __future__ import annotations

import math

import pytest

from groupflow.actors.reward import _GRACE_S, MAX_FAILED_STARTS, RewardPool
from groupflow.actors.starting import Replacements
from groupflow.core.records import Prompt, Response, SampledGroup, Verdict
from groupflow.core.start_errors import StartError
from tests.unit.job_loop_fakes import DIED, FAILED, Clock, FakeFutures, FakeRef, Remote

TIMEOUT_S = 10.0  # reward.timeout_s
SCORE_S = 1.0  # what a batch takes a worker that answers


class FakeWorker:
    """Scores its batches one after another, SCORE_S each: a response is right when its text
    is "right". `fate`: "scores"; "hangs" (never answers); "dies" (half-way through each
    batch). Up `up_s` after it was started, or fails then with `start_error`."""

    def __init__(self, clock: Clock, fate: str = "scores", up_s: float = 1.0, start_error=""):
        self.clock, self.fate = clock, fate
        self.free_at = clock.now
        self.batches = 0  # score calls received
        self.score = Remote(self._score)
        up_at = clock.now + up_s
        self.ready = Remote(
            lambda: FakeRef(up_at, FAILED if start_error else None, start_error or "up")
        )

    def _score(self, items, deadline_unix):
        self.batches += 1
        if self.fate == "hangs":
            return FakeRef(math.inf, None, "hung")
        start = max(self.clock.now, self.free_at)
        if self.fate == "dies":
            self.free_at = math.inf  # nothing after its death answers
            return FakeRef(start + SCORE_S / 2, DIED, "worker died")
        self.free_at = start + SCORE_S
        verdicts = [Verdict(float(text == "right"), f"read {text}") for _, text in items]
        return FakeRef(self.free_at, (verdicts, 0, 0), "scored")


def groups(chunk: int, n: int = 2) -> list[SampledGroup]:
    """`n` groups of two responses, one right and one wrong."""
    return [
        SampledGroup(
            Prompt(f"{chunk}/{i}", "q", 1),
            [1],
            [Response([1], "right", [0.0]), Response([2], "wrong", [0.0])],
            0,
        )
        for i in range(n)
    ]


class Pool:
    """A RewardPool over `workers`; each replacement is the next of `replacements` (a fake
    worker made on the clock when it is started)."""

    def __init__(self, workers: list[FakeWorker], replacements=(), max_retries: int = 1):
        self.clock = workers[0].clock
        self.futures = FakeFutures(self.clock, [])
        self.started: list[FakeWorker] = []
        self.ended: list[FakeWorker] = []
        coming = iter(replacements)

        def start_worker() -> FakeWorker:
            make = next(coming, lambda clock: FakeWorker(clock))
            self.started.append(make(self.clock))
            return self.started[-1]

        self.pool = RewardPool(
            list(workers),
            self.futures,
            TIMEOUT_S,
            max_retries,
            start_worker,
            replacements=Replacements(
                "reward worker",
                lambda worker: worker.ready.remote(),
                self.futures,
                {"CPU": 1.0},
                placed=lambda worker: True,
                cluster=lambda: ([{"CPU": 1.0}], {"CPU": 0.0}),
                end=self.ended.append,
                clock=lambda: self.clock.now,
            ),
            clock=lambda: self.clock.now,
        )

    def settle_replacements(self) -> None:
        """Wait until every replacement asked for is up (or failed)."""
        while self.pool.in_flight():
            self.pool.take(self.futures.wait_any(self.pool.in_flight()))


def rewards(scored) -> list[list[float]]:
    return [s.rewards for s in scored]


def test_a_hung_workers_batch_is_scored_zero_at_its_deadline_and_the_worker_replaced():
    clock = Clock()
    hung, healthy = FakeWorker(clock, "hangs"), FakeWorker(clock)
    pool = Pool([hung, healthy])
    pool.pool.submit(groups(0), chunk_id=0)  # to worker 0, which hangs
    pool.pool.submit(groups(1), chunk_id=1)
    assert pool.pool.seconds_to_deadline() == TIMEOUT_S + _GRACE_S
    scored = pool.pool.wait_all()
    assert rewards(scored[1]) == [[1.0, 0.0]] * 2  # at SCORE_S, the other worker's
    # The wait woke at the hung batch's deadline, not later: the virtual clock says when.
    assert clock.now == TIMEOUT_S + _GRACE_S
    assert rewards(scored[0]) == [[0.0, 0.0]] * 2
    assert {v.error for s in scored[0] for v in s.verdicts} == {"timeout"}
    assert pool.pool.timeouts == 4, "each response of the hung batch is a timeout"
    # not retried (that would stall the step again): the worker is ended and replaced
    assert healthy.batches == 1 and pool.ended == [hung] and len(pool.started) == 1
    pool.settle_replacements()
    assert pool.pool.workers == [pool.started[0], healthy]
    assert pool.pool.state().live == 2 and pool.pool.pending_groups() == 0


def test_a_dead_workers_batch_is_retried_on_another_and_its_slot_refilled():
    clock = Clock()
    dying, healthy = FakeWorker(clock, "dies"), FakeWorker(clock)
    pool = Pool([dying, healthy])
    pool.pool.submit(groups(0), chunk_id=0)
    pool.pool.submit(groups(1), chunk_id=1)
    scored = pool.pool.wait_all()
    # Retried once, on the worker left (after the batch it held): scored, not zeroed.
    assert rewards(scored[0]) == rewards(scored[1]) == [[1.0, 0.0]] * 2
    assert healthy.batches == 2 and clock.now == 2 * SCORE_S
    assert pool.pool.errors == pool.pool.timeouts == 0
    assert pool.ended == [dying] and len(pool.started) == 1
    pool.settle_replacements()
    assert pool.pool.workers[0] is pool.started[0] and pool.pool.state().live == 2


@pytest.mark.parametrize("max_retries", [0, 2])
def test_a_batch_is_tried_at_most_max_retries_more_times_then_scored_zero(max_retries):
    """The pool's one worker, and each replacement, dies in every batch: the batch waits for
    each replacement and goes to it until it has been tried 1 + max_retries times."""
    clock = Clock()
    first = FakeWorker(clock, "dies")
    pool = Pool(
        [first], replacements=[lambda c: FakeWorker(c, "dies")] * 5, max_retries=max_retries
    )
    pool.pool.submit(groups(0), chunk_id=0)
    scored = pool.pool.wait_all()
    tried = [first, *pool.started]
    assert sum(w.batches for w in tried) == 1 + max_retries
    assert rewards(scored[0]) == [[0.0, 0.0]] * 2
    assert {v.reason for s in scored[0] for v in s.verdicts} == {"reward worker lost its worker"}
    assert pool.pool.timeouts == 4
    assert len(pool.ended) == 1 + max_retries  # every dead worker ended, once


def test_replacements_that_keep_failing_to_start_stop_the_job():
    clock = Clock()
    failing = [lambda c: FakeWorker(c, start_error="ImportError: no module named plugin")] * 5
    pool = Pool([FakeWorker(clock, "dies")], replacements=failing)
    pool.pool.submit(groups(0), chunk_id=0)
    with pytest.raises(StartError, match="ImportError: no module named plugin"):
        pool.pool.wait_all()
    assert len(pool.started) == MAX_FAILED_STARTS
    assert pool.pool.pending_groups() == 2, "the batch still waits for a worker"
