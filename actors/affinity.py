"""Pinning an actor's threads to cores, to keep generation and learning off each other's cores
where a machine shares them (Linux: os.sched_setaffinity)."""

from __future__ import annotations

import os


def pin_to_cores(cores: list[int]) -> None:
    """Every thread of this process on `cores` (nothing when empty); threads started later
    inherit the affinity of the thread that starts them."""
    if not cores:
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
