"""Weight sync from the learner to the engines (groupflow.peers.WeightSync).

Both transports send the model in buckets of whole layers (learner/weight_export.py) of up to
`rollout.weight_bucket_mb`, one after the other, so no learner rank holds a second copy of the
model.
`ObjectStoreTransport` (any cluster): every rank yields its own ZeRO-3 partition of each
bucket, one flat array, from a streaming Ray generator; nothing is gathered among the ranks,
and each rank sends 1/world of the model. Each partition enters the object store on its own
and the references are forwarded to every engine as they arrive. An engine loads the sync in a
single vLLM pass that takes each bucket as soon as its partitions have arrived: it fetches them
(in place, from the ranks on its node), puts the parameters back together and loads them
while the ranks lay out the next buckets. The driver only passes references, never the
tensors.
`CollectiveTransport`: a broadcast from rank 0 to the engines over NCCL (GPUs) or gloo (CPUs):
rank 0 gathers the next bucket while the current one is in transfer, and each engine loads a
bucket as soon as it has arrived, while the next one arrives.

Both return with references the caller waits on. An engine runs its calls in order, so it
loads the weights after the chunks already sent to it and before any sent later.
"""

from __future__ import annotations

from itertools import zip_longest

import ray

from groupflow.actors.learner import LearnerGroup
from groupflow.learner.weight_export import DEFAULT_BUCKET_BYTES, bucket_manifest
from groupflow.peers import SyncHandles


class ObjectStoreTransport:
    def __init__(
        self, learner: LearnerGroup, engines: list, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ):
        self.learner = learner
        self.engines = engines
        self.bucket_bytes = bucket_bytes
        self.buckets = None

    def async_sync(self, version: int, engines: list | None = None) -> SyncHandles:
        engines = self.engines if engines is None else engines
        if self.buckets is None:  # what each flat bucket holds, cut as the learner cuts it
            manifest = ray.get(self.learner.ranks[0].weight_manifest.remote())
            self.buckets = bucket_manifest(manifest, self.bucket_bytes)
        streams = self.learner.async_stream_weights(self.bucket_bytes)
        loads = [e.load_streamed_weights.remote(self.buckets, version) for e in engines]
        # Each stream hands out a reference per bucket as the rank has laid it out (this
        # waits for it); wrapped in a list, the engines keep them unfetched until they load.
        # A rank that fails ends its stream early (its last reference holds the error).
        forwarded = 0
        try:
            for shards in zip_longest(*streams):
                if None in shards:
                    break
                for engine in engines:
                    engine.add_weights.remote(version, list(shards))
                forwarded += 1
        finally:
            if forwarded < len(self.buckets):  # or the engines would wait for the rest
                for engine in engines:
                    engine.add_weights.remote(version, None)
        # The buckets are in the object store once the streams complete: the learner may
        # train on while the engines load them. A failed rank fails its stream's handle.
        return SyncHandles([stream.completed() for stream in streams], loads)


class CollectiveTransport:
    """Learner rank 0 broadcasts the parameters bucket by bucket, as they are gathered from the
    ZeRO-3 shards, to every engine over a process group of its own (actors/weight_group.py);
    the engines receive in place and load. The group is opened on the first sync."""

    def __init__(
        self, learner: LearnerGroup, engines: list, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ):
        self.learner = learner
        self.engines = engines
        self.bucket_bytes = bucket_bytes
        self.buckets = None

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
        # The engines cut the same buckets as the learner ranks.
        manifest = ray.get(ranks[0].weight_manifest.remote())
        self.buckets = bucket_manifest(manifest, self.bucket_bytes)

    def async_sync(self, version: int, engines: list | None = None) -> SyncHandles:
        if engines is not None and engines != self.engines:
            # Its engines never change (a death ends the job), so none ever awaits alone.
            raise ValueError("the collective transport broadcasts to all of its engines")
        if self.buckets is None:
            self._open()
        # The ranks' broadcast ends only when every engine has received.
        return SyncHandles(
            [r.broadcast_weights.remote(self.bucket_bytes) for r in self.learner.ranks],
            [e.receive_weights.remote(self.buckets, version) for e in self.engines],
        )


def make_transport(
    kind: str, learner: LearnerGroup, engines: list, bucket_mb: int
) -> ObjectStoreTransport | CollectiveTransport:
    bucket_bytes = bucket_mb * 2**20
    if kind == "object_store":
        return ObjectStoreTransport(learner, engines, bucket_bytes)
    if kind == "collective":
        return CollectiveTransport(learner, engines, bucket_bytes)
    raise ValueError(f"rollout.weight_transport: unknown transport {kind!r}")
