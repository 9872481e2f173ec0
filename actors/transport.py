"""Weight sync from the learner to the engines (groupflow.peers.WeightSync).

Both transports send the model in buckets of whole layers (groupflow/weight_format.py) of up to
`rollout.weight_bucket_mb`, one after the other, so no learner rank holds a second copy of the
model.
`ObjectStoreTransport` (any cluster): every rank puts its own ZeRO-3 partition of each bucket,
one flat array, into Ray's object store as soon as it is laid out and hands the reference to
every engine itself; nothing is gathered among the ranks, each rank sends 1/world of the
model, and the driver is not on the weight path (it starts the sync and returns). An engine
loads the sync in a single vLLM pass that takes each bucket as soon as every rank's partition
of it is in: it fetches them (in place, from the ranks on its node), puts the parameters back
together and loads them while the ranks lay out the next buckets.
`CollectiveTransport`: a broadcast from rank 0 to the engines over NCCL (GPUs) or gloo (CPUs):
rank 0 gathers the next bucket while the current one is in transfer, and each engine loads a
bucket as soon as it has arrived, while the next one arrives.

Both return at once with references the caller waits on. A chunk sent to an engine after a
sync samples once that sync is loaded (actors/generator_actor.py, `min_version`). The buckets
are cut once, from learner rank 0's manifest, and handed to the ranks and the engines alike
(groupflow/weight_format.py). Every load is verified (`check_load`): the engine reports the
checksum of each tensor it loaded, the ranks theirs of what they sent, and one that differs
stops the job.
"""

from __future__ import annotations

import logging
import uuid

import ray

from groupflow.actors.futures import RayFutures
from groupflow.actors.learner import LearnerGroup
from groupflow.peers import SyncHandles
from groupflow.weight_format import (
    DEFAULT_BUCKET_BYTES,
    LoadedWeights,
    Manifest,
    add_checksums,
    bucket_manifest,
    check_loaded,
    sync_bytes,
)

log = logging.getLogger(__name__)


class WeightTransport:
    """What both transports share: the buckets, cut once, and the check of every load."""

    def __init__(
        self, learner: LearnerGroup, engines: list, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ):
        self.learner = learner
        self.engines = engines  # the generator pool's list: a slot may hold a replacement
        manifest = ray.get(learner.ranks[0].weight_manifest.remote())
        self.buckets: list[Manifest] = bucket_manifest(manifest, bucket_bytes)
        self.bytes_per_sync = sync_bytes(self.buckets, self._partitions)
        log.info(
            "a weight sync sends %d tensors, %.1f MiB in %d buckets",
            len(manifest),
            self.bytes_per_sync / 2**20,
            len(self.buckets),
        )
        # A load not checked yet -> (the engine, in words; the ranks' checksum shares).
        self._loads: dict[ray.ObjectRef, tuple[str, list[ray.ObjectRef]]] = {}

    @property
    def _partitions(self) -> int:
        """Flat tensors a bucket travels as."""
        raise NotImplementedError

    def async_sync(self, version: int, engines: list) -> SyncHandles:
        raise NotImplementedError

    def _note(self, engines: list, loads: list[ray.ObjectRef]) -> None:
        """Keep what checking `loads` takes: the ranks answer once their side is done."""
        sent = self.learner.async_sent_checksums()
        for engine, load in zip(engines, loads, strict=True):
            self._loads[load] = (self._describe(engine), sent)

    def _describe(self, engine) -> str:
        slot = next((i for i, e in enumerate(self.engines) if e is engine), None)
        return f"engine {slot} (actor {engine._actor_id.hex()[:12]})"

    def check_load(self, load: ray.ObjectRef, loaded: LoadedWeights | None) -> bool:
        """Check an engine's finished load (the value of its handle) against what the ranks
        sent; True where it was checked and matched, False for a load abandoned with a broken
        stream (the learner's failure, reported on its side). A mismatch raises
        WeightSyncMismatch: one line naming the engine, the version and the tensor."""
        engine, sent = self._loads.pop(load)
        if loaded is None:
            return False
        check_loaded(add_checksums(RayFutures().get(sent)), loaded, engine)
        return True

    def forget(self, load: ray.ObjectRef) -> None:
        """A load that will never be checked (its engine died)."""
        self._loads.pop(load, None)


class ObjectStoreTransport(WeightTransport):
    @property
    def _partitions(self) -> int:
        return self.learner.num_ranks  # each rank sends its own partition

    def async_sync(self, version: int, engines: list) -> SyncHandles:
        buckets, sync = self.buckets, uuid.uuid4().hex
        # The buckets are in the object store once the pushes are done: the learner may train
        # on while the engines load them. A rank that fails fails its push's handle, and its
        # engines abandon the load.
        pushes = self.learner.async_push_weights(buckets, sync, engines)
        loads = [e.load_streamed_weights.remote(buckets, version, sync, pushes) for e in engines]
        self._note(engines, loads)
        return SyncHandles(pushes, loads, list(engines))


class CollectiveTransport(WeightTransport):
    """Learner rank 0 broadcasts the parameters bucket by bucket, as they are gathered from the
    ZeRO-3 shards, to every engine over a process group of its own (actors/weight_group.py);
    the engines receive in place and load. The group is opened here, once the ranks and the
    engines are up (blocking), so that a sync returns at once."""

    def __init__(
        self, learner: LearnerGroup, engines: list, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ):
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
            [r.open_weight_group.remote(host, port, world) for r in ranks]
            + [
                e.open_weight_group.remote(host, port, i + 1, world)
                for i, e in enumerate(self.engines)
            ]
        )

    def async_sync(self, version: int, engines: list) -> SyncHandles:
        if engines != self.engines:
            # Its engines never change (a death ends the job), so none ever awaits alone.
            raise ValueError("the collective transport broadcasts to all of its engines")
        buckets = self.buckets
        # The ranks' broadcast ends only when every engine has received.
        sending = [r.broadcast_weights.remote(buckets) for r in self.learner.ranks]
        loads = [e.receive_weights.remote(buckets, version) for e in self.engines]
        self._note(self.engines, loads)
        return SyncHandles(sending, loads, list(self.engines))


def make_transport(
    kind: str, learner: LearnerGroup, engines: list, bucket_mb: int
) -> WeightTransport:
    bucket_bytes = bucket_mb * 2**20
    if kind == "object_store":
        return ObjectStoreTransport(learner, engines, bucket_bytes)
    if kind == "collective":
        return CollectiveTransport(learner, engines, bucket_bytes)
    raise ValueError(f"rollout.weight_transport: unknown transport {kind!r}")
