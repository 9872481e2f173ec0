"""The credit planner's collectives (learner/credit.py's `Reducer`) over torch.distributed."""

from __future__ import annotations

import torch
import torch.distributed as dist


class DistributedReducer:
    """Reductions over `group`: by default the default process group, which the learner ranks
    form; with sequence parallelism the ranks that hold the same shard of different sequences
    (learner/sequence_parallel.py), so that each sequence counts once. `device` is the one the
    group's backend reduces on (groupflow/core/device.py): NCCL takes CUDA tensors only, and
    the planner's own tensors may live on the host."""

    def __init__(
        self, world_size: int, device: torch.device, group: dist.ProcessGroup | None = None
    ):
        self.world_size = world_size  # the group's size
        self.device = device
        self.group = group

    def _all_reduce(self, t: torch.Tensor, op) -> torch.Tensor:
        out = t.detach().to(self.device, copy=True)
        dist.all_reduce(out, op=op, group=self.group)
        return out.to(t.device)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(t, dist.ReduceOp.SUM)

    def max(self, t: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(t, dist.ReduceOp.MAX)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        # Lengths differ between ranks, which all_gather does not allow: gather as objects.
        parts: list = [None] * self.world_size
        dist.all_gather_object(parts, t.detach().cpu(), group=self.group)
        return torch.cat(parts).to(t.device)
