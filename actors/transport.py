"""Weight sync from the learner to the engines, behind one small interface.

`ObjectStoreTransport` (CPU and any cluster): learner rank 0 gathers the full parameters
from the ZeRO-3 shards and puts them once into Ray's object store; every engine reads that
one object and loads it in place. The driver only passes references, never the tensors.
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


def make_transport(kind: str) -> WeightTransport:
    if kind == "object_store":
        return ObjectStoreTransport()
    raise ValueError(f"rollout.weight_transport: unknown transport {kind!r}")
