"""The credit planner's collectives (learner/credit.py's `Reducer`) over torch.distributed."""

from __future__ import annotations

import torch
import torch.distributed as dist


class DistributedReducer:
    """Reductions over the default process group, which the learner ranks form."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def _all_reduce(self, t: torch.Tensor, op) -> torch.Tensor:
        out = t.detach().clone()
        dist.all_reduce(out, op=op)
        return out

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(t, dist.ReduceOp.SUM)

    def max(self, t: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(t, dist.ReduceOp.MAX)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        # Lengths differ between ranks, which all_gather does not allow: gather as objects.
        parts: list = [None] * self.world_size
        dist.all_gather_object(parts, t.detach().cpu())
        return torch.cat(parts).to(t.device)
