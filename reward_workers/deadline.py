"""Call a function with a wall-clock deadline, from any thread, without signals.

Python threads cannot be killed, so a call that overruns keeps running in its daemon thread
while the caller moves on. Such stragglers are counted; past MAX_STRAGGLERS, new calls fail
at once instead of piling up more threads (a verifier that always hangs must not exhaust
the worker).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

MAX_STRAGGLERS = 16

_lock = threading.Lock()
_stragglers = 0


class DeadlineExceeded(TimeoutError):
    pass


def call_with_deadline(fn: Callable[[], T], timeout_s: float) -> T:
    """Return fn()'s result or raise its exception; DeadlineExceeded after timeout_s seconds."""
    global _stragglers
    with _lock:
        if _stragglers >= MAX_STRAGGLERS:
            raise DeadlineExceeded(
                f"{_stragglers} earlier calls are still running past their deadline"
            )
    outcome: dict[str, object] = {}
    done = threading.Event()
    state = {"abandoned": False}

    def run() -> None:
        global _stragglers
        try:
            outcome["value"] = fn()
        except BaseException as err:  # handed to the caller, whatever it is
            outcome["error"] = err
        with _lock:
            done.set()
            if state["abandoned"]:
                _stragglers -= 1

    threading.Thread(target=run, name="deadline-call", daemon=True).start()
    done.wait(timeout_s)
    with _lock:  # run() sets `done` under this lock, so the two cannot race
        if not done.is_set():
            state["abandoned"] = True
            _stragglers += 1
            raise DeadlineExceeded(f"no result within {timeout_s:g} s")
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]


def straggler_count() -> int:
    with _lock:
        return _stragglers
