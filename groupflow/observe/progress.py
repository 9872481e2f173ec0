"""Progress of the driver's long phases (the warm start, the actors' start, held-out evaluation)
in plain lines, which read the same on a terminal, in a log file, under `groupflow submit` and
in CI.

A phase says where it is at most every `every_s` seconds: its elapsed time and, with a count,
how many of how many and about how long is left. A phase that took `every_s` or more ends with
a line of its total time; a shorter one says nothing, so quick starts stay quiet. A
phase that waits on others with nothing of its own to count (an evaluation blocked on its
engines) keeps saying through a heartbeat thread (`heartbeat`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

# Often enough that a silent minute never happens, rarely enough that an eight-minute warm
# start is a screenful.
EVERY_S = 15.0


def clock_text(seconds: float) -> str:
    """Seconds as m:ss, or h:mm:ss from an hour."""
    whole = int(max(0.0, seconds) + 0.5)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class PhaseProgress:
    """One phase's progress lines. `update` (the phase's own loop) and `tick` (a heartbeat) may
    be called as often as wanted; a line is said only when `every_s` has passed since the
    last one."""

    def __init__(
        self,
        what: str,
        total: int | None = None,
        unit: str = "",
        *,
        every_s: float | None = None,  # EVERY_S
        clock: Callable[[], float] = time.monotonic,
        say: Callable[[str], None] = log.info,
    ):
        self.what, self.total, self.unit = what, total, unit
        self.every_s = EVERY_S if every_s is None else every_s
        self.clock, self.say = clock, say
        self.started = self._said_at = clock()
        self.done = 0
        self.note = ""  # what the phase is doing now, or a figure of its own (a loss)
        self.said = False
        self._lock = threading.Lock()  # a heartbeat thread ticks beside the phase's own calls

    def update(self, done: int | None = None, note: str | None = None) -> None:
        with self._lock:
            if done is not None:
                self.done = done
            if note is not None:
                self.note = note
        self.tick()

    def tick(self) -> None:
        with self._lock:
            now = self.clock()
            if now - self._said_at < self.every_s:
                return
            self._said_at, self.said = now, True
            line = self._line(now)
        self.say(line)

    def _line(self, now: float) -> str:
        elapsed = now - self.started
        parts = [] if self.total is None else [f"{self.done}/{self.total} {self.unit}".rstrip()]
        if self.note:
            parts.append(self.note)
        parts.append(f"{clock_text(elapsed)} elapsed")
        if self.total is not None and 0 < self.done < self.total:
            left = elapsed / self.done * (self.total - self.done)
            parts.append(f"about {clock_text(left)} left")
        return f"{self.what}: " + ", ".join(parts)

    def close(self) -> None:
        """The closing line, for a phase that said anything on the way or took `every_s`."""
        with self._lock:
            elapsed = self.clock() - self.started
            if not self.said and elapsed < self.every_s:
                return
            count = "done" if self.total is None else f"{self.done}/{self.total} {self.unit}"
            line = f"{self.what}: {count.rstrip()} in {clock_text(elapsed)}"
        self.say(line)


@contextmanager
def heartbeat(progress: PhaseProgress, poll_s: float = 1.0) -> Iterator[PhaseProgress]:
    """Tick `progress` from a thread while the block runs (it blocks on others), and close it
    when the block has ended well."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(poll_s):
            progress.tick()

    thread = threading.Thread(target=beat, name=f"progress: {progress.what}", daemon=True)
    thread.start()
    try:
        yield progress
    finally:
        stop.set()
        thread.join()
    progress.close()
