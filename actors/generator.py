"""Generator actors (vLLM engines that sample groups, a request each, and load new weights
while they run) and the pool that spreads a rollout over them.

The pool is the twin of the reward pool (actors/reward.py): it sends each chunk of prompts to
the engine with the least outstanding work and hands chunks on as they finish, so scoring
starts while later chunks still generate. A chunk sent to an engine after a weight load
starts once that load is done (Generator.sample).

An engine that dies (killed, out of memory, node lost) is one restart, charged to the job's
budget (groupflow/recovery.py) however many of its calls fail. Its slot takes no work from then
on and a new actor is asked for it (actors/starting.py Replacements); the chunks it held go to
the engines still there, each once (the chunk records are shared with the prompt stream, so the
job loop sees each chunk's new handle without being told), and generation goes on with them.
The replacement fills the slot when it is up, on a node with room for it (a lost node's
replacement waits, pending, until one joins), and takes work once the job has sent it the
current weights (`weights_sent`).

Scaling (groupflow scale, rollout.autoscale): `scale_to` starts new engines or retires live
ones and returns at once; `settle`, between steps, admits the new engines that are up (each
waits for the current weights like a replacement, but is no restart) and removes retired
engines once every chunk they held has been taken, so no group is lost or generated twice.
Retiring takes the highest slots and removal renumbers the slots above: the engines list is
shared with the weight transport, so it only changes in `settle`, never during a sync.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import ray

from groupflow.actors.affinity import pin_to_cores
from groupflow.actors.futures import RayFutures
from groupflow.actors.starting import ActorSlots, Replacements, StartingActors
from groupflow.actors.tools import ToolPoolClient, start_tool_pool
from groupflow.actors.weight_group import open_weight_group
from groupflow.config import Config, SamplingConfig
from groupflow.device import Device, device_for
from groupflow.peers import Chunk, Futures, GenerationFigures, Handle, PeerDied
from groupflow.records import Prompt, SampledGroup
from groupflow.recovery import RestartBudget
from groupflow.rollout.engine import EngineSettings, RolloutEngine, engine_settings
from groupflow.rollout.weight_intake import broadcast, broken_stream, streamed
from groupflow.scaling import PoolState, ray_demand
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


# Chunks an engine holds at most, generating side by side (their groups batched continuously
# with each other): when one ends, the other keeps the engine busy while the driver sends the
# next. The rest wait in the prompt stream, for whichever engine frees up first.
CHUNKS_PER_ENGINE = 2


def chunk_size(num_prompts: int, num_engines: int) -> int:
    """A step's prompts in CHUNKS_PER_ENGINE chunks per engine: the first chunks are scored
    while the second generate."""
    return max(1, num_prompts // (CHUNKS_PER_ENGINE * num_engines))


class GeneratorPool:
    """The engines as one pool (groupflow.peers.Generation)."""

    def __init__(
        self,
        engines: list,
        futures: Futures,
        group_size: int,
        sampling: SamplingConfig,
        restarts: RestartBudget,
        start_engine: Callable[[int], object] | None = None,
        starting: StartingActors | None = None,
        replacements: Replacements | None = None,
        demand: Mapping[str, float] | None = None,
        clock: Callable[[], float] = time.monotonic,
        tool_workers: Sequence = (),
    ):
        """`starting` and `replacements` stand in for Ray's in the job loop's unit tests;
        `demand` is one engine's Ray resources (said when a replacement waits for room);
        `tool_workers` the tool pool the engines call (actors/tools.py), stopped with them."""
        self.tool_workers = list(tool_workers)
        self.engines = engines  # the weight transport loads the engines of this same list
        self.futures = futures
        self.group_size = group_size
        self.sampling = sampling
        self.start_engine = start_engine  # a new actor for slot i; None: deaths are fatal
        self.restarts = restarts  # each replacement is charged here
        self._outstanding = [0] * len(engines)  # prompts sent to each engine, not yet taken
        self._chunks_on = [0] * len(engines)  # chunks sent to each engine, not yet taken
        self._clock = clock
        self._idle_engine_s = 0.0
        self._idle_counted_at = clock()
        self._chunks: dict[Handle, Chunk] = {}
        self._unloaded: set[int] = set()  # slots whose new engine awaits the weights
        self._lost: list[Chunk] = []  # chunks of dead engines, to generate again
        self._dead_retiring: set[int] = set()  # retiring slots whose engine died

        def warm_up(engine):  # an engine is ready once warmed up (see Generator.warm_up)
            return engine.warm_up.remote(group_size, sampling)

        if starting is None:
            starting = StartingActors("engine", warm_up)
        if replacements is None:
            replacements = Replacements("engine", warm_up, futures, demand or {})
        # retiring and vacant slots are sent no new chunks
        self.slots = ActorSlots(engines, starting, replacements)
        self._next_seed_slot = len(engines)  # a new engine samples with a seed of its own
        # New engines not yet sent a chunk -> when they were asked for: the time a scale-up
        # takes to produce work is logged, and kept in join_seconds.
        # (The handle is kept, so that its id is not reused while it is a key.)
        self._asked_at: dict[int, tuple[object, float]] = {}
        self.join_seconds: list[float] = []

    def figures(self) -> GenerationFigures:
        self._count_idle()
        return GenerationFigures(
            len(self.engines),
            self._idle_engine_s,
            sum(self._outstanding),
            len(self._taking_work()),
        )

    def send(self, chunks: Sequence[Chunk], version: int) -> None:
        ready = self._taking_work()
        if ready:  # the chunks of dead engines first: they come first in the stream
            self._resend_lost(version)
        room = sum(max(0, CHUNKS_PER_ENGINE - self._chunks_on[e]) for e in ready)
        for chunk in chunks[:room]:
            self._send(chunk, version)

    def _send(self, chunk: Chunk, version: int) -> None:
        self._count_idle()
        ready = self._taking_work()
        chunk.engine = min(ready, key=lambda e: (self._chunks_on[e], self._outstanding[e]))
        chunk.actor = self.engines[chunk.engine]
        self._outstanding[chunk.engine] += len(chunk.prompts)
        self._chunks_on[chunk.engine] += 1
        if self._asked_at and id(chunk.actor) in self._asked_at:
            seconds = time.monotonic() - self._asked_at.pop(id(chunk.actor))[1]
            self.join_seconds.append(seconds)
            log.info("a new engine took its first chunk %.1fs after it was asked for", seconds)
        chunk.handle = chunk.actor.sample.remote(
            chunk.prompts, self.group_size, self.sampling, version
        )
        chunk.sent = self._clock()
        self._chunks[chunk.handle] = chunk

    def _taking_work(self) -> list[int]:
        """Slots that take new chunks: loaded with the current weights, neither retiring nor
        vacant (their engine died)."""
        skip = self._unloaded | self.slots.idle()
        return [e for e in range(len(self.engines)) if e not in skip]

    def in_flight(self) -> list[Handle]:
        return list(self._chunks) + self.slots.replacements.handles()

    def _count_idle(self) -> None:
        """Add the engine-seconds since the last call in which engines held no chunk (call
        before the number of chunks on an engine changes)."""
        now = self._clock()
        idle = sum(1 for n in self._chunks_on if n == 0)
        self._idle_engine_s += idle * (now - self._idle_counted_at)
        self._idle_counted_at = now

    def take(self, ready: Sequence[Handle]) -> list[tuple[Chunk, list[SampledGroup]]]:
        taken = []
        self._count_idle()
        for handle in [h for h in ready if h in self._chunks]:
            chunk = self._chunks.pop(handle)
            self._outstanding[chunk.engine] -= len(chunk.prompts)
            self._chunks_on[chunk.engine] -= 1
            try:
                (groups,) = self.futures.get([handle])
            except PeerDied as err:
                self.lost(chunk.actor, str(err))
                self._lost.append(chunk)
                continue
            chunk.generated = self._clock()
            taken.append((chunk, groups))
        self._admit_replacements(ready)
        return taken

    def lost(self, engine, cause: str) -> None:
        """`engine` died (one of its chunks, loads or answers failed): one restart, however
        many of its calls fail; its slot takes no work, and a replacement is asked for."""
        slot = next((i for i, e in enumerate(self.engines) if e is engine), None)
        if slot is None or slot in self.slots.vacant() | self._dead_retiring:  # known
            return
        if self.start_engine is None:
            raise PeerDied(cause)
        self.restarts.charge("engine", f"engine {slot} died: {cause}")
        # One only unreachable for now (Ray's ActorUnavailableError) must not come back to hold
        # resources beside its replacement.
        self.slots.replacements.end(engine)
        self._unloaded.discard(slot)
        if slot in self.slots.retiring:  # it was leaving: settle removes it
            self._dead_retiring.add(slot)
            return
        self.slots.replacements.ask(slot, lambda: self.start_engine(slot))
        serving = len(self._taking_work())
        log.warning(
            "engine %d lost (%s); a replacement is asked for; %s",
            slot,
            cause,
            f"generation goes on with {serving} engine(s)"
            if serving
            else "no engine is left: generation waits for it",
        )

    def _admit_replacements(self, ready: Sequence[Handle]) -> None:
        up, failed = self.slots.replacements.take(ready)
        for slot, engine in up:  # it takes work once it holds the current weights
            self.slots.fill(slot, engine)
            self._unloaded.add(slot)
        for slot, why in failed:
            self.restarts.charge("engine", why)
            self.slots.replacements.ask(slot, lambda slot=slot: self.start_engine(slot))

    def drop_lost(self) -> None:
        """Forget the lost chunks: their rollouts were abandoned."""
        self._lost.clear()

    def engines_to_sync(self, only_awaiting: bool) -> list:
        if only_awaiting:
            return [self.engines[slot] for slot in sorted(self._unloaded)]
        return [e for slot, e in enumerate(self.engines) if slot not in self.slots.vacant()]

    def weights_sent(self) -> None:
        """Call once the current weights have been sent to the engines (to every engine
        that awaited them): new engines take work."""
        self._unloaded.clear()

    def _resend_lost(self, version: int) -> None:
        """Send the lost chunks again, to engines with the current weights (`version`); each
        gets its new handle."""
        lost, self._lost = self._lost, []
        for chunk in lost:
            self._send(chunk, version)

    def complete(
        self,
        prompts: list[Prompt],
        n: int,
        sampling: SamplingConfig,
        greedy: bool,
        version: int,
    ) -> list[SampledGroup] | None:
        serving = [self.engines[slot] for slot in self._taking_work()]
        if not serving:
            return None
        k = len(serving)
        calls = [
            e.complete.remote(prompts[i::k], n, sampling, greedy, version)
            for i, e in enumerate(serving)
        ]
        groups: list = [None] * len(prompts)
        answered = True
        for i, (engine, call) in enumerate(zip(serving, calls, strict=True)):
            try:
                groups[i::k] = self.futures.get([call])[0]
            except PeerDied as err:
                self.lost(engine, str(err))
                answered = False
        return groups if answered else None

    # ----- scaling (between steps; see the module's docstring) ---------------------------------
    def scale_to(self, target: int) -> None:
        if self.start_engine is None:
            raise ValueError("engines cannot be added or removed with this weight transport")
        if target < 1:
            raise ValueError(f"a pool needs at least one engine (got {target})")

        def start():
            engine = self.start_engine(self._next_seed_slot)
            self._next_seed_slot += 1
            return engine

        for engine in self.slots.scale_to(target, start):
            self._asked_at[id(engine)] = (engine, time.monotonic())

    def settle(self) -> PoolState:
        joined = len(self.slots.admit())  # appended in place: the transport holds this list
        self._outstanding += [0] * joined
        self._chunks_on += [0] * joined
        # No chunk before the current weights.
        self._unloaded.update(range(len(self.engines) - joined, len(self.engines)))
        held = {chunk.engine for chunk in self._chunks.values()}
        drained = self.slots.drained(held | self._unloaded)
        for slot in drained:
            self._remove(slot)
        return self.slots.state(joined, len(drained))

    def _remove(self, slot: int) -> None:
        """Remove an engine that holds no chunk, and renumber the slots above it."""
        engine = self.slots.remove(slot)
        del self._outstanding[slot]
        del self._chunks_on[slot]

        def moved(e: int) -> int:
            return e - 1 if e > slot else e

        self._unloaded = {moved(e) for e in self._unloaded if e != slot}
        self._dead_retiring = {moved(e) for e in self._dead_retiring if e != slot}
        for chunk in self._chunks.values():
            chunk.engine = moved(chunk.engine)
        for chunk in self._lost:  # placed anew when sent again
            chunk.engine = -1
        # Exits after the calls already queued on it (a weight load the job still awaits).
        engine.__ray_terminate__.remote()

    def state(self) -> PoolState:
        return self.slots.state()

    def shutdown(self) -> None:
        self.slots.starting.shutdown()
        self.slots.replacements.shutdown()
        for actor in [*self.engines, *self.tool_workers]:
            ray.kill(actor)


def start_generator_pool(
    cfg: Config, model_path: str, restarts: RestartBudget | None = None
) -> GeneratorPool:
    """`rollout.num_engines` generator actors, each placed by its declared resources; a dead
    one is replaced by a new actor with the same settings (with the object-store transport:
    the collective one's process group cannot take a new member, so a death ends the job).
    Replacements are charged to `restarts`, the job's budget shared with the learner (a
    pool on its own gets one of its own)."""
    if restarts is None:
        restarts = RestartBudget(cfg.trainer.max_restarts)
    res = cfg.rollout.resources
    device = device_for(res.num_gpus)
    actor = ray.remote(Generator).options(
        num_cpus=res.num_cpus,
        num_gpus=res.num_gpus,
        resources=res.custom,
        runtime_env={
            "env_vars": {
                "OMP_NUM_THREADS": str(res.torch_threads),
                **device.engine_env(),
            }
        },
    )

    tool_workers = start_tool_pool(cfg)

    def start_engine(slot: int):
        settings = engine_settings(cfg, model_path, seed=cfg.trainer.seed + slot)
        return actor.remote(settings, device, res.cpu_cores, tool_workers)

    engines = [start_engine(i) for i in range(cfg.rollout.num_engines)]
    replaceable = cfg.rollout.weight_transport == "object_store"
    return GeneratorPool(
        engines,
        RayFutures(),
        cfg.rollout.group_size,
        cfg.rollout.sampling,
        restarts,
        start_engine if replaceable else None,
        demand=ray_demand(res.num_cpus, res.num_gpus, res.custom),
        tool_workers=tool_workers,
    )
