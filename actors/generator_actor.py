"""The generator actor, in the engine's process: a vLLM engine (rollout/engine.py) that samples
groups, a request each, and loads new weights while it runs. The pool that spreads a rollout
over these actors, in the driver's process, is actors/generator.py.

A chunk sent to an engine after a weight load starts once that load is done (`sample`'s
`min_version`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

import ray

from groupflow.actors.affinity import pin_to_cores
from groupflow.actors.tools import ToolPoolClient
from groupflow.actors.weight_group import open_weight_group
from groupflow.config import SamplingConfig
from groupflow.device import Device
from groupflow.records import Prompt, SampledGroup
from groupflow.rollout.engine import EngineSettings, RolloutEngine
from groupflow.rollout.weight_intake import broadcast, broken_stream, streamed
from groupflow.weight_format import LoadedWeights, Manifest

log = logging.getLogger(__name__)


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


class Generator:
    """An async actor: every call runs in its event loop, so chunks generate side by side (each
    group a request of its own, batched continuously by vLLM) while weights arrive and load.

    Ray starts an async actor's calls in no guaranteed order, so a chunk says which weights it
    needs: `sample` waits until the engine holds version `min_version` (the newest the job had
    sent when it sent the chunk), or a load has ended since the chunk arrived (a failed load,
    or one that took the engine back to an older version after the learner was rebuilt from a
    checkpoint: the group then carries the version that sampled it, and the prompt stream
    drops it if the learner does not hold that version's successors)."""

    def __init__(
        self, settings: EngineSettings, device: Device, cores: list[int], tool_workers: list
    ):
        pin_to_cores(cores)  # before vLLM starts its threads, which inherit it
        run_code = ToolPoolClient(tool_workers).run if tool_workers else None
        self.engine = RolloutEngine(settings, run_code)
        self.device = device
        self.weight_group = None
        self._arriving_buckets: dict[str, ArrivingBuckets] = {}  # by sync
        self._ended_syncs: set[str] = set()
        self._loads_ended = 0  # weight loads done (loaded or failed)
        self._load_ended = asyncio.Condition()

    async def sample(
        self,
        prompts: list[Prompt],
        group_size: int,
        sampling: SamplingConfig,
        min_version: int = 0,
    ) -> list[SampledGroup]:
        await self._holds(min_version)
        return await asyncio.gather(
            *(self.engine.sample_group(p, group_size, sampling) for p in prompts)
        )

    async def complete(
        self,
        prompts: list[Prompt],
        n: int,
        sampling: SamplingConfig,
        greedy: bool,
        min_version: int = 0,
    ) -> list[SampledGroup]:
        await self._holds(min_version)
        return await self.engine.complete(prompts, n, sampling, greedy)

    async def warm_up(self, group_size: int, sampling: SamplingConfig) -> None:
        """Sample once, so that a new engine's first real chunk is not slowed by the engine's
        first-call costs (seconds on CPU), which would hold up the whole step."""
        await self.sample([Prompt("warm-up", "1+1=", 2)] * 2, group_size, sampling)

    async def _holds(self, version: int) -> None:
        ended = self._loads_ended
        async with self._load_ended:
            await self._load_ended.wait_for(
                lambda: self.engine.policy_version >= version or self._loads_ended > ended
            )

    async def add_weights(self, sync: str, index: int, rank: int, part: list | None) -> None:
        """Learner rank `rank`'s partition of bucket `index` of sync `sync` (a reference in a
        list, so that Ray does not fetch it here), or None: the rank failed there. A part of a
        sync already ended is let go (its load was abandoned)."""
        if sync not in self._ended_syncs:
            self._arriving(sync).put(index, rank, part)

    def _arriving(self, sync: str) -> ArrivingBuckets:
        return self._arriving_buckets.setdefault(sync, ArrivingBuckets())

    async def load_streamed_weights(
        self, buckets: list[Manifest], version: int, sync: str, pushes: list
    ) -> LoadedWeights | None:
        """Load sync `sync` (policy `version`) in one vLLM pass, each bucket as soon as every
        rank's partition of it has arrived (add_weights), fetching one bucket at a time
        (rollout/weight_intake.py); the engine samples on until the first bucket is whole.
        `pushes` are the ranks' handles of their side (LearnerRankActor.push_weights): one
        that fails (a rank died) ends the load. Returns what was loaded, or None where the
        learner failed part-way: that failure is the learner's to report (its side of the
        sync fails, and the job rebuilds it and syncs every engine again), so it must not read
        as this engine's; the layers not loaded keep their weights
        (rollout/weight_receiver.py). A failure of the engine's own raises."""
        arriving = self._arriving(sync)
        arriving.expect(len(pushes))
        watching = [asyncio.create_task(_failure_of(push, arriving)) for push in pushes]
        try:
            async with self._loading():
                await asyncio.to_thread(arriving.wait_first)  # sample on until it is in
                indices = iter(range(len(buckets)))
                pairs = streamed(
                    buckets, lambda: arriving.get(next(indices)), ray.get, self.device.kind
                )
                return await self.engine.load(pairs, version)
        except Exception as err:
            broken = broken_stream(err)
            if broken is None:
                raise
            log.warning(
                "weight sync %d abandoned, the learner's stream failed: %s", version, broken
            )
            return None
        finally:
            for task in watching:
                task.cancel()
            del self._arriving_buckets[sync]
            self._ended_syncs.add(sync)

    @contextlib.asynccontextmanager
    async def _loading(self):
        try:
            yield
        finally:
            # A failed load too: the chunks waiting for it sample with the weights there are
            # (their groups carry that version: staleness decides what is trained on).
            async with self._load_ended:
                self._loads_ended += 1
                self._load_ended.notify_all()

    def open_weight_group(self, host: str, port: int, rank: int, world_size: int) -> None:
        self.weight_group = open_weight_group(host, port, rank, world_size, self.device.backend)

    async def receive_weights(self, buckets: list[Manifest], version: int) -> LoadedWeights:
        async with self._loading():
            received = broadcast(self.weight_group, buckets, self.device.kind)
            return await self.engine.load(received, version)

    async def parameters_snapshot(self) -> dict:
        return await self.engine.parameters_snapshot()


async def _failure_of(push, arriving: ArrivingBuckets) -> None:
    """Fail `arriving` if the rank's push fails (its rank died): its parts would never come."""
    try:
        await push
    except Exception:
        arriving.fail()
