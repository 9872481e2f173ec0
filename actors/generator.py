"""The generator pool, in the driver's process: it spreads a rollout over the generator actors
(actors/generator_actor.py: vLLM engines that sample groups, a request each, and load new
weights while they run).

The pool is the twin of the reward pool (actors/reward.py): it sends each chunk of prompts to
the engine with the least outstanding work and hands chunks on as they finish, so scoring
starts while later chunks still generate. A chunk sent to an engine after a weight load
starts once that load is done (Generator.sample).

An engine that dies (killed, out of memory, node lost) is one restart, charged to the job's
budget (groupflow/core/recovery.py) however many of its calls fail. Its slot takes no work from then
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

import logging
import time
from collections.abc import Callable, Mapping, Sequence

import ray

from groupflow.actors.futures import RayFutures
from groupflow.actors.generator_actor import Generator
from groupflow.actors.starting import ActorSlots, Replacements, StartingActors
from groupflow.actors.tools import start_tool_pool
from groupflow.actors.transport_registry import transport_class
from groupflow.config import Config, SamplingConfig
from groupflow.core.device import device_for
from groupflow.core.peers import (
    CHUNKS_PER_ENGINE,
    Chunk,
    Futures,
    GenerationFigures,
    Handle,
    PeerDied,
)
from groupflow.core.records import Prompt, SampledGroup
from groupflow.core.recovery import RestartBudget
from groupflow.core.scaling_protocol import PoolState, ray_demand
from groupflow.core.threads import thread_env
from groupflow.rollout.engine import engine_settings

log = logging.getLogger(__name__)


class GeneratorPool:
    """The engines as one pool (groupflow.core.peers.Generation)."""

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
    one is replaced by a new actor with the same settings (where the weight transport is
    `elastic`: one whose members are fixed, a process group, ends the job at a death).
    Replacements are charged to `restarts`, the job's budget shared with the learner (a
    pool on its own gets one of its own)."""
    if restarts is None:
        restarts = RestartBudget(cfg.trainer.max_restarts)
    res = cfg.rollout.resources
    device = device_for(res.num_gpus)
    # An engine's OpenMP pool stays at 1 unless torch_threads says otherwise: on a GPU its hot
    # loop gains nothing from intra-op threads, which spin between its small CPU ops (vLLM sets
    # them to 1 there); on a CPU node vLLM sizes its own attention threads by the cores it binds,
    # and stops the engine when OpenMP's pool is larger (num_cpus is logical and may count more
    # than the node's cores: "thread_num == thread_num (3 vs. 2)"). Its CPUs go to the tokenizer.
    intra_op = 1 if res.torch_threads is None else None
    actor = ray.remote(Generator).options(
        num_cpus=res.num_cpus,
        num_gpus=res.num_gpus,
        resources=res.custom,
        runtime_env={"env_vars": {**thread_env(res.threads, intra_op), **device.engine_env()}},
    )

    tool_workers = start_tool_pool(cfg)

    def start_engine(slot: int):
        settings = engine_settings(cfg, model_path, seed=cfg.trainer.seed + slot)
        return actor.remote(settings, device, res.cpu_cores, tool_workers)

    engines = [start_engine(i) for i in range(cfg.rollout.num_engines)]
    replaceable = transport_class(cfg.rollout.weight_transport).elastic
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
