"""A wall-clock budget for a computation in pure Python, so that it ends as a verdict.

A scorer process (reward_workers/verifier_pool.py) is killed at its call's deadline, and a
kill costs a timeout verdict and a fresh process that imports sympy again. A verifier that
knows part of its work can run long (sympy simplifying an expression against a wrong answer)
spends a budget inside that deadline instead: SIGALRM interrupts the computation between two
Python bytecodes and the verifier gives its own verdict. Computation in C that never returns
to Python is still stopped only by the kill.

The budget needs the process's main thread and a free SIGALRM (no handler of another's, no
timer running); where either is missing it does nothing and the deadline alone applies.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class BudgetSpent(BaseException):
    """Not an Exception: sympy and math-verify catch Exception around their own steps, and
    would turn the interruption into a wrong result instead of ending the computation."""


def _spent(_signum: int, _frame: object) -> None:
    raise BudgetSpent


def _alarm_is_free() -> bool:
    handler = signal.getsignal(signal.SIGALRM)
    return handler in (signal.SIG_DFL, None) and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


@contextlib.contextmanager
def within(seconds: float | None) -> Iterator[None]:
    """Raise BudgetSpent in the body once `seconds` have passed (None: no budget)."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    if not _alarm_is_free():
        yield
        return
    signal.signal(signal.SIGALRM, _spent)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
