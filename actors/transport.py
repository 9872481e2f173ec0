"""Weight sync from the learner to the engines, behind one small interface.

`ObjectStoreTransport` (any cluster): learner rank 0 gathers the full parameters from the
ZeRO-3 shards and puts them once into Ray's object store; every engine reads that one object
and loads it in place. The driver only passes references, never the tensors.
`CollectiveTransport`: a broadcast from rank 0 to the engines over NCCL (GPUs) or gloo (CPUs),
one parameter at a time, with no copy of the whole model anywhere.
"""

from __future__ import annotations

from typing import Protocol

import ray


class WeightTransport(Protocol):
    def sync(self, learner, engines: list, version: int) -> None:
        """Make every engine serve the learner's current parameters as `version`."""


class ObjectStoreTransport:
    def sync(self, learner, engines: list, version: int) -> None:
        bundle_ref = learner.publish_weights()
        ray.get([engine.load_weights.remote(bundle_ref, version) for engine in engines])


class CollectiveTransport:
    """Learner rank 0 broadcasts each parameter, as it is gathered from the ZeRO-3 shards,
    to every engine over a process group of its own (NCCL on GPUs, gloo on CPUs); the
    engines receive in place and load. Set up on the first sync."""

    def __init__(self) -> None:
        self.manifest = None

    def _open(self, learner, engines: list) -> None:
        host, port = ray.get(learner.ranks[0].address.remote())
        world = 1 + len(engines)
        ray.get(
            [r.open_weight_group.remote(host, port, world) for r in learner.ranks]
            + [e.open_weight_group.remote(host, port, i + 1, world) for i, e in enumerate(engines)]
        )
        self.manifest = ray.get(learner.ranks[0].weight_manifest.remote())

    def sync(self, learner, engines: list, version: int) -> None:
        if self.manifest is None:
            self._open(learner, engines)
        ray.get(
            [r.broadcast_weights.remote() for r in learner.ranks]
            + [e.receive_weights.remote(self.manifest, version) for e in engines]
        )


def make_transport(kind: str) -> WeightTransport:
    if kind == "object_store":
        return ObjectStoreTransport()
    if kind == "collective":
        return CollectiveTransport()
    raise ValueError(f"rollout.weight_transport: unknown transport {kind!r}")
