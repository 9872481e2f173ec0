"""The object-store transport (`rollout.weight_transport: object_store`, the default; any
cluster): every learner rank puts its own ZeRO-3 partition of each bucket, one flat array,
into Ray's object store as soon as it is laid out and hands the reference to every engine
itself. Nothing is gathered among the ranks, each rank sends 1/world of the model, and the
driver is not on the weight path (it starts the sync and returns). An engine loads the sync
in a single vLLM pass that takes each bucket as soon as every rank's partition of it is in: it
fetches them (in place, from the ranks on its node), puts the parameters back together and
loads them while the ranks lay out the next buckets.

Its members may change (`elastic`): each sync names the engines it goes to, so a replaced or
new engine is one more receiver, and new learner ranks push as the old ones did.

The driver's side is `ObjectStoreTransport`; the ranks run `push` (learner/weight_export.py
`shard_buckets` lays out the partitions) and the engines `receive_part` and `load_streamed`
(rollout/weight_intake.py `streamed` puts the parameters back together).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid

import ray

from groupflow.actors.transport import WeightTransport
from groupflow.core.peers import SyncHandles
from groupflow.core.weight_format import LoadedWeights, Manifest
from groupflow.rollout.weight_intake import broken_stream, streamed

log = logging.getLogger(__name__)


class ObjectStoreTransport(WeightTransport):
    elastic = True

    @property
    def _partitions(self) -> int:
        return self.learner.num_ranks  # each rank sends its own partition

    def async_sync(self, version: int, engines: list) -> SyncHandles:
        buckets, sync = self.buckets, uuid.uuid4().hex
        # The buckets are in the object store once the pushes are done: the learner may train
        # on while the engines load them. A rank that fails fails its push's handle, and its
        # engines abandon the load.
        pushes = push_partitions(self.learner.ranks, buckets, sync, engines)
        loads = [
            e.weight_sync.remote(load_streamed, buckets, version, sync, pushes) for e in engines
        ]
        self._note(engines, loads)
        return SyncHandles(pushes, loads, list(engines))


def push_partitions(ranks: list, buckets: list, sync: str, engines: list) -> list[ray.ObjectRef]:
    """Every rank hands its partitions of `buckets` to `engines` (`push`); a handle per rank,
    ready when its partitions are all in the object store."""
    return [r.weight_sync.remote(push, buckets, sync, engines) for r in ranks]


# ----- on each learner rank (actors/learner.py LearnerRankActor) --------------------------------
def push(actor, buckets: list, sync: str, engines: list) -> None:
    """Put this rank's partition of each bucket into the object store as soon as it is laid
    out and hand its reference to every engine (`receive_part`) without waiting for them:
    nothing is gathered among the ranks and the driver is not on the weight path. A partition
    goes as the bytes of its flat tensor in a numpy array: Ray writes that into the object
    store in one copy and an engine on the node reads it in place (a torch tensor would be
    pickled, and copied). On CPU the array is a view of the live partitions (`shard_buckets`);
    ray.put has copied it before the next is laid out. A push that fails part-way tells the
    engines where, so they abandon the sync."""
    import torch

    rank, sent = actor.rank.setup.rank, 0
    try:
        for shard in actor.rank.weight_shard_buckets(buckets):
            # the bytes, on the CPU: a GPU rank keeps its partitions on its device
            ref = ray.put(shard.view(torch.uint8).cpu().numpy())
            for engine in engines:  # in a list, so that Ray does not fetch it for the call
                engine.weight_sync.remote(receive_part, sync, sent, rank, [ref])
            sent += 1
    finally:
        if sent < len(buckets):
            for engine in engines:
                engine.weight_sync.remote(receive_part, sync, sent, rank, None)


# ----- on each engine (actors/generator_actor.py Generator) ------------------------------------
class ArrivingBuckets:
    """A sync's partitions as the learner ranks hand them in: Ray starts an async actor's calls
    in no guaranteed order, so each carries its bucket index and rank. A bucket is whole once
    every rank's partition is in; the thread that loads takes whole buckets in order."""

    def __init__(self):
        self.ranks: int | None = None  # known once the load starts (`expect`)
        self._parts: dict[int, dict[int, object]] = {}  # bucket -> rank -> reference
        self._failed_at: int | None = None  # no bucket from here on will be whole
        self._arrived = threading.Condition()

    def expect(self, ranks: int) -> None:
        with self._arrived:
            self.ranks = ranks
            self._arrived.notify_all()

    def put(self, index: int, rank: int, part: list | None) -> None:
        """Rank `rank`'s partition of bucket `index` (its reference, in a list), or None: the
        rank failed there, and sends nothing more."""
        if part is None:
            self.fail(index)
            return
        with self._arrived:
            self._parts.setdefault(index, {})[rank] = part[0]
            self._arrived.notify_all()

    def fail(self, index: int = 0) -> None:
        """No bucket from `index` on that is not whole yet will be (a rank failed)."""
        with self._arrived:
            failed_at = self._failed_at
            self._failed_at = index if failed_at is None else min(failed_at, index)
            self._arrived.notify_all()

    def get(self, index: int) -> list | None:
        """Bucket `index`'s references in rank order once it is whole (taken), or None where
        a rank failed before it was."""
        with self._arrived:
            self._arrived.wait_for(lambda: self._settled(index))
            parts = self._parts.pop(index, {})
            return [parts[r] for r in range(self.ranks)] if self._whole(parts) else None

    def wait_first(self) -> None:
        """Until the first bucket is whole, or a rank failed."""
        with self._arrived:
            self._arrived.wait_for(lambda: self._settled(0))

    def _whole(self, parts: dict) -> bool:
        return self.ranks is not None and len(parts) == self.ranks

    def _settled(self, index: int) -> bool:
        failed = self._failed_at is not None and index >= self._failed_at
        return failed or self._whole(self._parts.get(index, {}))


class Streams:
    """An engine's syncs under way, and those ended (a part of one is let go)."""

    def __init__(self):
        self.arriving: dict[str, ArrivingBuckets] = {}  # by sync
        self.ended: set[str] = set()

    def of(self, sync: str) -> ArrivingBuckets:
        return self.arriving.setdefault(sync, ArrivingBuckets())


async def receive_part(actor, sync: str, index: int, rank: int, part: list | None) -> None:
    """Learner rank `rank`'s partition of bucket `index` of sync `sync` (a reference in a
    list, so that Ray does not fetch it here), or None: the rank failed there. A part of a
    sync already ended is let go (its load was abandoned)."""
    streams = actor.sync_state(Streams)
    if sync not in streams.ended:
        streams.of(sync).put(index, rank, part)


async def load_streamed(
    actor, buckets: list[Manifest], version: int, sync: str, pushes: list
) -> LoadedWeights | None:
    """Load sync `sync` (policy `version`) in one vLLM pass, each bucket as soon as every
    rank's partition of it has arrived (`receive_part`), fetching one bucket at a time
    (rollout/weight_intake.py); the engine samples on until the first bucket is whole.
    `pushes` are the ranks' handles of their side (`push`): one that fails (a rank died) ends
    the load. Returns what was loaded, or None where the learner failed part-way: that failure
    is the learner's to report (its side of the sync fails, and the job rebuilds it and syncs
    every engine again), so it must not read as this engine's; the layers not loaded keep
    their weights (rollout/weight_receiver.py). A failure of the engine's own raises."""
    streams = actor.sync_state(Streams)
    arriving = streams.of(sync)
    arriving.expect(len(pushes))
    watching = [asyncio.create_task(_failure_of(push, arriving)) for push in pushes]
    try:
        async with actor.loading():
            await asyncio.to_thread(arriving.wait_first)  # sample on until it is in
            indices = iter(range(len(buckets)))
            pairs = streamed(
                buckets, lambda: arriving.get(next(indices)), ray.get, actor.device.kind
            )
            return await actor.engine.load(pairs, version)
    except Exception as err:
        broken = broken_stream(err)
        if broken is None:
            raise
        log.warning("weight sync %d abandoned, the learner's stream failed: %s", version, broken)
        return None
    finally:
        for task in watching:
            task.cancel()
        del streams.arriving[sync]
        streams.ended.add(sync)


async def _failure_of(push, arriving: ArrivingBuckets) -> None:
    """Fail `arriving` if the rank's push fails (its rank died): its parts would never come."""
    try:
        await push
    except Exception:
        arriving.fail()
