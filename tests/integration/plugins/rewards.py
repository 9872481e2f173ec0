"""Reward plugins used by the integration tests (loaded by file path, as users would)."""

import time


def slow_exact(prompt: str, response: str, answer) -> float:
    """Correct arithmetic answers score 1 after a pause long enough to kill a worker mid-batch."""
    time.sleep(0.05)
    return 1.0 if response.strip() == str(answer) else 0.0


def sleeps_past_timeout(prompt: str, response: str, answer) -> float:
    """Sleeps on every other prompt (by its text) well past the test's 0.5 s timeout."""
    if sum(map(ord, prompt)) % 2:
        time.sleep(2.0)
    return 1.0
