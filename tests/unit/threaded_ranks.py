"""Simulated data-parallel ranks in one process, for unit tests of collective code."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import torch

T = TypeVar("T")


class ThreadedRanks:
    """world_size ranks, one thread each: collectives meet at a barrier, so code written
    against learner/credit.py's Reducer runs unchanged over ranks that really exchange data."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=60)
        self.slots: list[torch.Tensor | None] = [None] * world_size

    def exchange(self, rank: int, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's tensor, in rank order."""
        self.slots[rank] = t
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before every rank has read them all
        return values

    def run(self, on_rank: Callable[[int], T]) -> list[T]:
        """on_rank(rank) on every rank at once; the results in rank order."""

        def guarded(rank: int) -> T:
            try:
                return on_rank(rank)
            except BaseException:
                self.barrier.abort()  # fail the other ranks now instead of at the timeout
                raise

        with ThreadPoolExecutor(self.world_size) as pool:
            return list(pool.map(guarded, range(self.world_size)))


@dataclass
class RankReducer:
    """learner/credit.py's Reducer for one of the ThreadedRanks."""

    ranks: ThreadedRanks
    rank: int
    world_size: int = field(init=False)

    def __post_init__(self) -> None:
        self.world_size = self.ranks.world_size

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return torch.stack(self.ranks.exchange(self.rank, t)).sum(0)

    def max(self, t: torch.Tensor) -> torch.Tensor:
        return torch.stack(self.ranks.exchange(self.rank, t)).amax(0)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.ranks.exchange(self.rank, t))
