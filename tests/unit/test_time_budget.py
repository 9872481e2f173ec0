"""time_budget.within: a computation in Python ends at its budget, as an exception the
computation's own `except Exception` cannot swallow; nothing else's alarm is touched."""

import signal
import threading
import time

import pytest

from groupflow.reward_workers.tasks.time_budget import BudgetSpent, within


def _busy_swallowing_exceptions(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            sum(range(1000))
        except Exception:  # as sympy's and math-verify's steps do
            pass


def test_a_computation_past_its_budget_is_interrupted():
    start = time.monotonic()
    with pytest.raises(BudgetSpent), within(0.2):
        _busy_swallowing_exceptions(10.0)
    assert time.monotonic() - start < 2.0
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_DFL
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_computation_within_its_budget_leaves_no_alarm_behind():
    with within(0.5):
        _busy_swallowing_exceptions(0.01)
    time.sleep(0.6)  # a timer left running would raise here
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_no_budget_where_the_alarm_is_not_free():
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(1))
    try:
        with within(0.05):
            _busy_swallowing_exceptions(0.2)  # someone else's handler: left alone
        assert signal.getsignal(signal.SIGALRM) is not signal.SIG_DFL
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert fired == []

    outcome = []

    def in_a_thread():
        with within(0.05):
            _busy_swallowing_exceptions(0.2)
        outcome.append("finished")

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert outcome == ["finished"]  # SIGALRM reaches the main thread only: no budget there
