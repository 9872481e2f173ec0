"""Generator actors (vLLM engines that sample groups and load new weights between requests)
and the pool that spreads a rollout over them.

The pool is the twin of the reward pool (actors/reward.py): it sends each chunk of prompts to
the engine with the least outstanding work and hands chunks on as they finish, so scoring
starts while later chunks still generate. An engine runs its calls in the order they were
sent, so a weight load sent after a chunk is applied after that chunk.

An engine that dies (killed, out of memory, node lost) is replaced at once by a new actor in
its slot, a restart charged to the job's budget (groupflow/recovery.py). The replacement takes
no work until the job has sent it the current weights (`weights_sent`); the pool then sends
the chunks the dead engine held again itself, each once (the chunk records are shared with the
prompt stream, so the job loop sees each chunk's new handle without being told).

Scaling (groupflow scale, rollout.autoscale): `scale_to` starts new engines or retires live
ones and returns at once; `settle`, between steps, admits the new engines that are up (each
waits for the current weights like a replacement, but is no restart) and removes retired
engines once every chunk they held has been taken, so no group is lost or generated twice.
Retiring takes the highest slots and removal renumbers the slots above: the engines list is
shared with the weight transport, so it only changes in `settle`, never during a sync.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

import ray

from groupflow.actors.affinity import pin_to_cores
from groupflow.actors.futures import RayFutures
from groupflow.actors.starting import ActorSlots, StartingActors
from groupflow.actors.weight_group import open_weight_group
from groupflow.config import Config, SamplingConfig
from groupflow.device import Device, device_for
from groupflow.peers import Chunk, Futures, Handle, PeerDied
from groupflow.records import Prompt, SampledGroup
from groupflow.recovery import RestartBudget
from groupflow.rollout.engine import EngineSettings, RolloutEngine, engine_settings
from groupflow.rollout.weight_intake import broken_stream, streamed
from groupflow.scaling import PoolState
from groupflow.weight_format import LoadedWeights, Manifest

log = logging.getLogger(__name__)

# The concurrency group of the calls that hand an engine weight references while it samples
# or loads (Ray runs each group in its own thread; the default group's calls run in order).
WEIGHTS_IN = "weights_in"


class Generator:
    def __init__(self, settings: EngineSettings, device: Device, cores: list[int]):
        pin_to_cores(cores)  # before vLLM starts its threads, which inherit it
        self.engine = RolloutEngine(settings)
        self.device = device
        self.weight_group = None
        self._arriving_buckets: dict[int, queue.Queue] = {}  # sync version -> bucket refs
        self._arriving_lock = threading.Lock()

    def sample(
        self, prompts: list[Prompt], group_size: int, sampling: SamplingConfig
    ) -> list[SampledGroup]:
        return self.engine.sample_groups(prompts, group_size, sampling)

    def complete(
        self, prompts: list[Prompt], n: int, sampling: SamplingConfig, greedy: bool
    ) -> list[SampledGroup]:
        return self.engine.complete(prompts, n, sampling, greedy)

    def warm_up(self, group_size: int, sampling: SamplingConfig) -> None:
        """Sample once, so that a new engine's first real chunk is not slowed by the engine's
        first-call costs (seconds on CPU), which would hold up the whole step."""
        self.engine.sample_groups([Prompt("warm-up", "1+1=", 2)] * 2, group_size, sampling)

    @ray.method(concurrency_group=WEIGHTS_IN)
    def add_weights(self, version: int, shards: list[ray.ObjectRef] | None) -> None:
        """The references to the next bucket's partitions for sync `version`, in rank order
        (in a list, so Ray does not fetch them here), or None: the sync failed. Runs in a
        thread of its own, while the engine samples or loads."""
        self._arriving(version).put(shards)

    def _arriving(self, version: int) -> queue.Queue:
        with self._arriving_lock:
            return self._arriving_buckets.setdefault(version, queue.Queue())

    def load_streamed_weights(self, buckets: list[Manifest], version: int) -> LoadedWeights | None:
        """Load sync `version` in one vLLM pass, each bucket as soon as its references have
        arrived (add_weights), fetching one bucket at a time (rollout/weight_intake.py).
        Returns what was loaded, or None where the learner's stream failed part-way: that
        failure is the learner's to report (its side of the sync fails, and the job rebuilds
        it and syncs every engine again), so it must not read as this engine's; the layers not
        loaded keep their weights (rollout/weight_receiver.py). A failure of the engine's own
        raises."""
        arriving = self._arriving(version)
        try:
            return self.engine.load_weights(
                streamed(buckets, arriving.get, ray.get, self.device.kind), version
            )
        except Exception as err:
            broken = broken_stream(err)
            if broken is None:
                raise
            log.warning(
                "weight sync %d abandoned, the learner's stream failed: %s", version, broken
            )
            return None
        finally:
            with self._arriving_lock:
                del self._arriving_buckets[version]

    def open_weight_group(self, host: str, port: int, rank: int, world_size: int) -> None:
        self.weight_group = open_weight_group(host, port, rank, world_size, self.device.backend)

    def receive_weights(self, buckets: list[Manifest], version: int) -> LoadedWeights:
        return self.engine.receive_weights(self.weight_group, buckets, version, self.device.kind)

    def parameters_snapshot(self) -> dict:
        return self.engine.parameters_snapshot()


# Chunks an engine holds at most: one generating, one queued behind it so that the engine
# never waits for the driver. A weight load sent to an engine runs after these, so the bound
# is also how long a new version waits behind old work (groupflow/pipeline.py).
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
        clock: Callable[[], float] = time.monotonic,
    ):
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
        self._unloaded: set[int] = set()  # slots whose replacement awaits the weights
        self._lost: list[Chunk] = []  # chunks of dead engines, to generate again
        # Engines asked for and not yet up (a stand-in in the job loop's unit tests).
        if starting is None:  # an engine is ready once warmed up (see Generator.warm_up)
            starting = StartingActors("engine", lambda e: e.warm_up.remote(group_size, sampling))
        self.slots = ActorSlots(engines, starting)  # retiring slots are sent no new chunks
        self._next_seed_slot = len(engines)  # a new engine samples with a seed of its own
        # New engines not yet sent a chunk -> when they were asked for: the time a scale-up
        # takes to produce work is logged, and kept in join_seconds.
        # (The handle is kept, so that its id is not reused while it is a key.)
        self._asked_at: dict[int, tuple[object, float]] = {}
        self.join_seconds: list[float] = []

    @property
    def num_engines(self) -> int:
        return len(self.engines)

    def room(self) -> int:
        """How many more chunks the engines with the current weights take now."""
        ready = self._taking_work()
        return sum(max(0, CHUNKS_PER_ENGINE - self._chunks_on[e]) for e in ready)

    def send(self, chunk: Chunk) -> None:
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
        chunk.handle = chunk.actor.sample.remote(chunk.prompts, self.group_size, self.sampling)
        chunk.sent = self._clock()
        self._chunks[chunk.handle] = chunk

    def _taking_work(self) -> list[int]:
        """Slots that take new chunks: loaded with the current weights and not retiring."""
        skip = self._unloaded | self.slots.retiring
        return [e for e in range(len(self.engines)) if e not in skip]

    def in_flight(self) -> list[Handle]:
        return list(self._chunks)

    def _count_idle(self) -> None:
        """Add the engine-seconds since the last call in which engines held no chunk (call
        before the number of chunks on an engine changes)."""
        now = self._clock()
        idle = sum(1 for n in self._chunks_on if n == 0)
        self._idle_engine_s += idle * (now - self._idle_counted_at)
        self._idle_counted_at = now

    def idle_engine_seconds(self) -> float:
        """Engine-seconds so far in which an engine held no chunk (it waited for work)."""
        self._count_idle()
        return self._idle_engine_s

    def take(self, ready: Sequence[Handle]) -> list[tuple[Chunk, list[SampledGroup]]]:
        taken = []
        self._count_idle()
        for handle in [h for h in ready if h in self._chunks]:
            chunk = self._chunks.pop(handle)
            self._outstanding[chunk.engine] -= len(chunk.prompts)
            self._chunks_on[chunk.engine] -= 1
            try:
                (groups,) = self.futures.get([handle])
            except PeerDied:
                if self.start_engine is None:
                    raise
                self._lose(chunk)
                continue
            chunk.generated = self._clock()
            taken.append((chunk, groups))
        return taken

    def _lose(self, chunk: Chunk) -> None:
        self._lost.append(chunk)
        if self.engines[chunk.engine] is chunk.actor:  # not replaced yet
            self._replace(chunk.engine)

    def _replace(self, slot: int) -> None:
        self.engines[slot] = self.start_engine(slot)
        self._unloaded.add(slot)
        self.restarts.charge("engine", f"engine {slot} died")

    def replace_dead(self) -> int:
        """Probe every engine and replace the dead ones (a death noticed outside a chunk:
        in an evaluation or a weight load); how many were replaced."""
        if self.start_engine is None:
            return 0
        dead = []
        for slot, engine in enumerate(self.engines):
            try:
                self.futures.get([engine.__ray_ready__.remote()])
            except PeerDied:
                dead.append(slot)
        for slot in dead:
            self._replace(slot)
        return len(dead)

    def drop_lost(self) -> None:
        """Forget the lost chunks: their rollouts were abandoned."""
        self._lost.clear()

    def needs_weights(self) -> bool:
        """A replacement waits for the current weights (and lost chunks wait for it)."""
        return bool(self._unloaded)

    def awaiting_weights(self) -> list:
        return [self.engines[slot] for slot in sorted(self._unloaded)]

    def weights_sent(self) -> None:
        """Call once a weight load has been sent to every engine that awaited one:
        replacements take work from now on (their calls run after the load). The lost chunks
        are sent again."""
        self._unloaded.clear()
        self.resend_lost()

    def resend_lost(self) -> None:
        """Send the lost chunks again, to engines with the current weights (a chunk of a
        dead engine can fail after its replacement got them); each gets its new handle."""
        lost, self._lost = self._lost, []
        for chunk in lost:
            self.send(chunk)

    def queued_prompts(self) -> int:
        return sum(self._outstanding)

    def complete(
        self, prompts: list[Prompt], n: int, sampling: SamplingConfig, greedy: bool
    ) -> list[SampledGroup]:
        k = len(self.engines)
        shards = self.futures.get(
            [
                e.complete.remote(prompts[i::k], n, sampling, greedy)
                for i, e in enumerate(self.engines)
            ]
        )
        groups: list = [None] * len(prompts)
        for i, shard in enumerate(shards):
            groups[i::k] = shard
        return groups

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
        for engine in self.engines:
            ray.kill(engine)


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
    actor = ray.remote(concurrency_groups={WEIGHTS_IN: 1})(Generator).options(
        num_cpus=res.num_cpus,
        num_gpus=res.num_gpus,
        resources=res.custom,
        runtime_env={
            "env_vars": {
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "OMP_NUM_THREADS": str(res.torch_threads),
                **device.engine_env(),
            }
        },
    )

    def start_engine(slot: int):
        settings = engine_settings(cfg, model_path, seed=cfg.trainer.seed + slot)
        return actor.remote(settings, device, res.cpu_cores)

    engines = [start_engine(i) for i in range(cfg.rollout.num_engines)]
    replaceable = cfg.rollout.weight_transport == "object_store"
    return GeneratorPool(
        engines,
        RayFutures(),
        cfg.rollout.group_size,
        cfg.rollout.sampling,
        restarts,
        start_engine if replaceable else None,
    )
