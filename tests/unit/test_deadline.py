"""Calls with a deadline from any thread, and the cap on calls left running."""

import threading
import time

import pytest

from groupflow.reward_workers import deadline
from groupflow.reward_workers.deadline import DeadlineExceeded, call_with_deadline, straggler_count


def test_returns_the_result_or_the_exception():
    assert call_with_deadline(lambda: 41 + 1, 1.0) == 42
    with pytest.raises(ZeroDivisionError):
        call_with_deadline(lambda: 1 / 0, 1.0)


def test_times_out_without_blocking_the_caller():
    release = threading.Event()
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        call_with_deadline(release.wait, 0.1)
    assert time.monotonic() - start < 0.5
    assert straggler_count() >= 1
    release.set()
    end = time.monotonic() + 2
    while straggler_count() and time.monotonic() < end:
        time.sleep(0.01)
    assert straggler_count() == 0


def test_too_many_stragglers_fail_fast(monkeypatch):
    monkeypatch.setattr(deadline, "MAX_STRAGGLERS", 2)
    release = threading.Event()
    try:
        for _ in range(2):
            with pytest.raises(DeadlineExceeded):
                call_with_deadline(release.wait, 0.05)
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded, match="still running"):
            call_with_deadline(lambda: 1, 5.0)
        assert time.monotonic() - start < 0.05
    finally:
        release.set()
    end = time.monotonic() + 2
    while straggler_count() and time.monotonic() < end:
        time.sleep(0.01)
    assert call_with_deadline(lambda: 1, 1.0) == 1
