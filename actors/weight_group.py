"""The weight group: a process group for broadcasting weights from learner rank 0 to the
engines (a Ray-layer concern: the actors open it; learner/ only sees a `Broadcaster`).

It is built from a TCPStore and torch's backend classes directly, so it lives beside each
process's own default group (DeepSpeed's on the learner, vLLM's in an engine) without
touching it. The backend follows the hardware: NCCL between GPUs, gloo on CPUs.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

TIMEOUT = datetime.timedelta(minutes=10)


@dataclass
class WeightGroup:
    store: dist.TCPStore  # kept alive as long as the group
    group: dist.ProcessGroup
    rank: int

    def start_broadcast(self, tensor: torch.Tensor) -> dist.Work:
        """Rank 0 sends `tensor`; every other rank receives into it, in place. Returns at once:
        the caller overlaps the transfer with its next bucket and then waits on the result."""
        return self.group.broadcast(tensor, 0)


def open_weight_group(
    host: str, port: int, rank: int, world_size: int, backend: str
) -> WeightGroup:
    """Join the group (collective: every member calls it); rank 0 hosts the store."""
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=TIMEOUT)
    if backend == "nccl":
        group = dist.ProcessGroupNCCL(store, rank, world_size)
    else:
        group = dist.ProcessGroupGloo(store, rank, world_size, TIMEOUT)
    return WeightGroup(store, group, rank)
