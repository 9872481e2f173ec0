"""The weight transports, by the name `rollout.weight_transport` gives them.

A new transport is a file of its own, actors/transport_<name>.py (copy
actors/transport_collective.py: its `WeightTransport` subclass and the steps it sends to the
ranks and the engines), one line in TRANSPORTS, and its name in the config's `Literal`
(groupflow/config.py RolloutConfig.weight_transport; tests/unit/test_transports.py fails until
the two agree).
"""

from __future__ import annotations

from groupflow.actors.transport import WeightTransport
from groupflow.actors.transport_collective import CollectiveTransport
from groupflow.actors.transport_object_store import ObjectStoreTransport

TRANSPORTS: dict[str, type[WeightTransport]] = {
    "object_store": ObjectStoreTransport,
    "collective": CollectiveTransport,
}


def transport_class(name: str) -> type[WeightTransport]:
    try:
        return TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"rollout.weight_transport: unknown transport {name!r}") from None


def make_transport(name: str, learner, engines: list, bucket_mb: int) -> WeightTransport:
    """The transport `name` between `learner` (actors/learner.py LearnerGroup) and `engines`
    (the generator pool's list), in buckets of up to `bucket_mb` MiB."""
    return transport_class(name)(learner, engines, bucket_mb * 2**20)
