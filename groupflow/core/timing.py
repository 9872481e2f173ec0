"""Stage times of a step: `with stage_timer("learn", times):` adds the block's wall time to
`times["learn"]`, which the step record reports as `time_learn_s`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def stage_timer(stage: str, times: dict[str, float]) -> Iterator[None]:
    """Time the block into `times[stage]`; a stage timed twice in one step adds up."""
    start = time.monotonic()
    try:
        yield
    finally:
        times[stage] = times.get(stage, 0.0) + time.monotonic() - start


def time_keys(times: dict[str, float]) -> dict[str, float]:
    """The step record's keys for stage times: "learn" -> "time_learn_s"."""
    return {f"time_{stage}_s": seconds for stage, seconds in times.items()}
