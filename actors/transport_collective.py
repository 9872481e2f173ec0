"""The collective transport (`rollout.weight_transport: collective`): learner rank 0
broadcasts the parameters bucket by bucket, as they are gathered from the ZeRO-3 shards, to
every engine over a process group of its own, the weight group: NCCL between GPUs, gloo on
CPUs. Rank 0 gathers the next bucket while the current one is in transfer, and each engine
loads a bucket as soon as it has arrived, while the next one arrives.

The weight group is built from a TCPStore and torch's backend classes directly, so it lives
beside each process's own default group (DeepSpeed's on the learner, vLLM's in an engine)
without touching it. It is opened once, when the ranks and the engines are up, and takes no
new members: the transport is not `elastic` (an engine's death ends the job, and the job
cannot scale its engines nor rebuild its learner).

The driver's side is `CollectiveTransport`; the ranks run `join_as_source` and `send`
(learner/weight_export.py `broadcast_weights` gathers and sends), the engines `join` and
`receive` (rollout/weight_intake.py `broadcast` receives).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import ray
import torch
import torch.distributed as dist

from groupflow.actors.transport import WeightTransport
from groupflow.core.peers import SyncHandles
from groupflow.core.weight_format import DEFAULT_BUCKET_BYTES, LoadedWeights, Manifest
from groupflow.rollout.weight_intake import broadcast

TIMEOUT = datetime.timedelta(minutes=10)


class CollectiveTransport(WeightTransport):
    """The group is opened here, once the ranks and the engines are up (blocking), so that a
    sync returns at once."""

    def __init__(self, learner, engines: list, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        super().__init__(learner, engines, bucket_bytes)
        self._open()

    @property
    def _partitions(self) -> int:
        return 1  # rank 0 sends each bucket whole

    def _open(self) -> None:
        ranks = self.learner.ranks
        host, port = ray.get(ranks[0].address.remote())
        world = 1 + len(self.engines)
        ray.get(
            [r.weight_sync.remote(join_as_source, host, port, world) for r in ranks]
            + [
                e.weight_sync.remote(join, host, port, i + 1, world)
                for i, e in enumerate(self.engines)
            ]
        )

    def async_sync(self, version: int, engines: list) -> SyncHandles:
        if engines != self.engines:
            # Its engines never change (a death ends the job), so none ever awaits alone.
            raise ValueError("the collective transport broadcasts to all of its engines")
        buckets = self.buckets
        # The ranks' broadcast ends only when every engine has received.
        sending = [r.weight_sync.remote(send, buckets) for r in self.learner.ranks]
        loads = [e.weight_sync.remote(receive, buckets, version) for e in self.engines]
        self._note(self.engines, loads)
        return SyncHandles(sending, loads, list(self.engines))


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


class Membership:
    """An actor's place in the weight group: None on the learner ranks other than rank 0,
    which only gather."""

    group: WeightGroup | None = None


# ----- on each learner rank (actors/learner.py LearnerRankActor) --------------------------------
def join_as_source(actor, host: str, port: int, world_size: int) -> None:
    """Rank 0 joins the engines' weight group as its source; other ranks only gather."""
    if actor.rank.setup.rank == 0:
        backend = actor.rank.setup.device.backend
        actor.sync_state(Membership).group = open_weight_group(host, port, 0, world_size, backend)


def send(actor, buckets: list[Manifest]) -> None:
    actor.rank.broadcast_weights(actor.sync_state(Membership).group, buckets)


# ----- on each engine (actors/generator_actor.py Generator) ------------------------------------
def join(actor, host: str, port: int, rank: int, world_size: int) -> None:
    backend = actor.device.backend
    actor.sync_state(Membership).group = open_weight_group(host, port, rank, world_size, backend)


async def receive(actor, buckets: list[Manifest], version: int) -> LoadedWeights:
    async with actor.loading():
        received = broadcast(actor.sync_state(Membership).group, buckets, actor.device.kind)
        return await actor.engine.load(received, version)
