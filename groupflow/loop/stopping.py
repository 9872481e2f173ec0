"""Ending a job early, on purpose: a stop asked by Ctrl-C, SIGTERM or `groupflow stop`.

A first request lets the step in flight finish (groupflow/loop/job.py), then the job writes what a
finished run writes, less the final evaluation (groupflow/run/driver.py: `finish_stopped`). A step
whose samples are still not in `trainer.stop_timeout_s` after the request is abandoned: its
samples are dropped and the job ends at the step before. Once the learner has a step's
samples the step finishes (a learner step cannot be cut halfway). A second request, or
`groupflow stop --now`, aborts at once: nothing more is written.

Nothing here imports Ray: `groupflow stop` reaches the job through its control actor
(groupflow/actors/control.py), which the driver asks through `poll`.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

STOP_COMMAND = "groupflow stop"  # the source of a stop asked through the control actor
# How often a job asks its control actor whether `groupflow stop` asked it to stop.
POLL_EVERY_S = 2.0


class StopAborted(KeyboardInterrupt):
    """A second stop request, or `groupflow stop --now`: the job ends at once, writing nothing
    more. A KeyboardInterrupt, so that nothing on the way catches it as an error."""


class StepAbandoned(Exception):
    """The step in flight did not have its samples within the stop deadline."""


class StopRequest:
    """Whether, since when and by whom the job was asked to stop."""

    def __init__(
        self,
        deadline_s: float,
        poll: Callable[[], str | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.deadline_s = deadline_s
        # Asks `groupflow stop`'s side (the control actor): None, "stop" or "now".
        self.poll = poll
        self.clock = clock
        self.source: str | None = None  # who asked first
        self.asked_at: float | None = None
        self._polled_at = float("-inf")

    @property
    def asked(self) -> bool:
        return self.source is not None

    def ask(self, source: str) -> None:
        """A request from `source` (words for the log). The first begins the stop; a second
        one aborts."""
        if self.asked:
            raise StopAborted(f"{source} while stopping: aborted at once, nothing more written")
        self.source, self.asked_at = source, self.clock()
        again = "groupflow stop --now" if source == STOP_COMMAND else f"{source} again"
        log.warning(
            "%s: stopping after the step in flight (abandoned if its samples are not in "
            "within %gs); %s aborts at once",
            source,
            self.deadline_s,
            again,
        )

    def check(self) -> bool:
        """Whether a stop was asked, looking at `groupflow stop`'s side at most every
        POLL_EVERY_S; `groupflow stop --now` raises StopAborted."""
        if self.poll is not None and self.clock() - self._polled_at >= POLL_EVERY_S:
            self._polled_at = self.clock()
            asked = self.poll()
            if asked == "now":
                raise StopAborted("groupflow stop --now: aborted at once, nothing more written")
            if asked == "stop" and not self.asked:
                self.ask(STOP_COMMAND)
        return self.asked

    def overdue(self) -> bool:
        """The stop was asked more than `deadline_s` ago."""
        return self.asked_at is not None and self.clock() - self.asked_at > self.deadline_s


class LoopStop:
    """A stop request (None: a job nobody stops) as the job loop meets it: before each step
    but never after the last (`asked`), and while a step waits for its samples
    (`waiting_for`), which it abandons once the stop is overdue (`check_waiting`)."""

    def __init__(self, request: StopRequest | None, steps: int):
        self.request = request
        self.steps = steps
        self.waiting_for: int | None = None  # a step waiting for its samples

    def asked(self, last_step: int) -> bool:
        """Whether to end the job before the step after `last_step`."""
        if self.request is None or last_step >= self.steps:
            return False
        return self.request.check()

    def check_waiting(self, last_step: int) -> None:
        """While the loop waits: StepAbandoned for a step still waiting for its samples past
        the stop's deadline."""
        if self.asked(last_step) and self.waiting_for is not None and self.request.overdue():
            log.warning(
                "step %d abandoned: its samples were not in within %gs of the stop",
                self.waiting_for,
                self.request.deadline_s,
            )
            self.waiting_for = None
            raise StepAbandoned


_SIGNAL_WORDS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


@contextmanager
def stop_on_signals(stop: StopRequest) -> Iterator[None]:
    """While in the block, SIGINT (Ctrl-C) and SIGTERM ask `stop`; the handlers before are
    put back after. Only the main thread can set handlers: elsewhere the block changes
    nothing."""
    try:
        before = {
            sig: signal.signal(sig, lambda n, _f: stop.ask(_SIGNAL_WORDS[n]))
            for sig in _SIGNAL_WORDS
        }
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
