"""Async users' code that blocks an engine's event loop: detected, counted and warned about.

An async tool or environment runs on the engine's event loop (rollout/user_calls.py) and is
trusted not to block it; one that does (time.sleep, a blocking socket, a long computation
between two awaits) holds every trajectory of the engine, its stepping and its weight loads.
Each run of such code on the loop, from one await to the next, is timed (`LoopWatch.timed`):
one that holds the loop BLOCKED_S or longer is counted (`LoopWatch.blocks`, and the
trajectory's `Response.loop_blocks`, which the step record sums as `event_loop_blocks`) and
warned about in one line naming the code. A run that never returns is seen by a watchdog
thread, which warns while it still holds the loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass

log = logging.getLogger(__name__)

BLOCKED_S = 0.5  # a run of async users' code on the loop this long is a block


class BlockCount:
    """The blocks of one trajectory's users' code (a trajectory sets it in its context)."""

    def __init__(self):
        self.n = 0


TRAJECTORY_BLOCKS: ContextVar[BlockCount | None] = ContextVar("loop_blocks", default=None)


@dataclass
class _Run:
    culprit: str
    since: float
    count: BlockCount | None
    reported: bool = False


class LoopWatch:
    def __init__(
        self,
        blocked_s: float = BLOCKED_S,
        clock: Callable[[], float] = time.monotonic,
        warn: Callable[..., None] = log.warning,
        watchdog: bool = True,
    ):
        self.blocked_s = blocked_s
        self.clock = clock
        self.warn = warn
        self.blocks = 0  # in this process, ever
        self._watchdog = watchdog
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._holding: _Run | None = None

    def timed(self, awaitable: Awaitable, culprit: str) -> Awaitable:
        """`awaitable`, each of its runs on the loop timed against `culprit`."""
        return _Timed(self, awaitable, culprit, TRAJECTORY_BLOCKS.get())

    def check(self) -> None:
        """Report the run holding the loop now, once, if it has held it BLOCKED_S (the
        watchdog thread's look)."""
        with self._lock:
            run = self._holding
            if run is not None:
                held = self.clock() - run.since
                if held >= self.blocked_s:
                    self._report(run, held, "and still holds it")

    def _begin(self, run: _Run) -> bool:
        """Whether `run` holds the loop now (an outer timed run already does)."""
        with self._lock:
            if self._holding is not None:
                return False
            self._holding = run
        if self._watchdog and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="loop-watch", daemon=True)
            self._thread.start()
        return True

    def _end(self, run: _Run) -> None:
        with self._lock:
            self._holding = None
            held = self.clock() - run.since
            if held >= self.blocked_s:
                self._report(run, held, "")

    def _report(self, run: _Run, held: float, still: str) -> None:
        if run.reported:
            return
        run.reported = True
        self.blocks += 1
        if run.count is not None:
            run.count.n += 1
        self.warn(
            "%s held the engine's event loop for %.1fs%s: async users' code must not block "
            "(await what it waits on, or make it a sync function, which runs in a thread)",
            run.culprit,
            held,
            f" {still}" if still else "",
        )

    def _watch(self) -> None:
        while True:
            time.sleep(self.blocked_s / 2)
            self.check()


class _Timed:
    def __init__(self, watch: LoopWatch, awaitable: Awaitable, culprit: str, count):
        self.watch, self.awaitable, self.culprit, self.count = watch, awaitable, culprit, count

    def __await__(self):
        inner = self.awaitable.__await__()
        value, thrown = None, None
        while True:
            run = _Run(self.culprit, self.watch.clock(), self.count)
            holding = self.watch._begin(run)
            try:
                yielded = inner.send(value) if thrown is None else inner.throw(thrown)
            except StopIteration as done:
                return done.value
            finally:
                if holding:
                    self.watch._end(run)
            try:
                value, thrown = (yield yielded), None
            except GeneratorExit:
                inner.close()
                raise
            except BaseException as err:  # thrown into the await (a cancellation): passed on
                value, thrown = None, err
