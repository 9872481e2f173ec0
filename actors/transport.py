"""Weight sync from the learner to the engines (groupflow.peers.WeightSync).

`ObjectStoreTransport` (any cluster): learner rank 0 gathers the full parameters from the
ZeRO-3 shards and returns them once into Ray's object store; every engine reads that one
object and loads it in place. The driver only passes references, never the tensors.
`CollectiveTransport`: a broadcast from rank 0 to the engines over NCCL (GPUs) or gloo (CPUs),
one parameter at a time, with no copy of the whole model anywhere.

Both return at once with references the caller waits on. An engine runs its calls in order,
so it loads the weights after the chunks already sent to it and before any sent later.
"""

from __future__ import annotations

import ray

from groupflow.actors.learner import LearnerGroup


class ObjectStoreTransport:
    def __init__(self, learner: LearnerGroup, engines: list):
        self.learner = learner
        self.engines = engines

    def async_sync(self, version: int) -> list[ray.ObjectRef]:
        published = self.learner.async_publish_weights()
        # Passing rank 0's reference makes each engine read the parameters from the store.
        loads = [engine.load_weights.remote(published[0], version) for engine in self.engines]
        return published[1:] + loads


class CollectiveTransport:
    """Learner rank 0 broadcasts each parameter, as it is gathered from the ZeRO-3 shards,
    to every engine over a process group of its own (actors/weight_group.py); the engines
    receive in place and load. The group is opened on the first sync."""

    def __init__(self, learner: LearnerGroup, engines: list):
        self.learner = learner
        self.engines = engines
        self.manifest = None

    def _open(self) -> None:
        ranks = self.learner.ranks
        host, port = ray.get(ranks[0].address.remote())
        world = 1 + len(self.engines)
        ray.get(
            [r.open_weight_group.remote(host, port, world) for r in ranks]
            + [
                e.open_weight_group.remote(host, port, i + 1, world)
                for i, e in enumerate(self.engines)
            ]
        )
        self.manifest = ray.get(ranks[0].weight_manifest.remote())

    def async_sync(self, version: int) -> list[ray.ObjectRef]:
        if self.manifest is None:
            self._open()
        return [r.broadcast_weights.remote() for r in self.learner.ranks] + [
            e.receive_weights.remote(self.manifest, version) for e in self.engines
        ]


def make_transport(
    kind: str, learner: LearnerGroup, engines: list
) -> ObjectStoreTransport | CollectiveTransport:
    if kind == "object_store":
        return ObjectStoreTransport(learner, engines)
    if kind == "collective":
        return CollectiveTransport(learner, engines)
    raise ValueError(f"rollout.weight_transport: unknown transport {kind!r}")
