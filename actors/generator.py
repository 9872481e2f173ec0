"""Generator actors (vLLM engines that sample groups and load new weights between requests)
and the pool that spreads a rollout over them.

The pool is the twin of the reward pool (actors/reward.py): it sends each chunk of prompts to
the engine with the least outstanding work and hands chunks on as they finish, so scoring
starts while later chunks still generate. An engine runs its calls in the order they were
sent, so a weight load sent after a chunk is applied after that chunk.

An engine that dies (killed, out of memory, node lost) is replaced at once by a new actor in
its slot. The replacement takes no work until the job has sent it the current weights
(`weights_sent`); the chunks the dead engine held are then generated again, each once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import ray

from groupflow.actors.affinity import pin_to_cores
from groupflow.actors.futures import RayFutures
from groupflow.actors.weight_group import open_weight_group
from groupflow.config import Config, SamplingConfig
from groupflow.learner.device import Device, device_for
from groupflow.peers import Futures, GeneratedChunk, Handle, PeerDied
from groupflow.records import Prompt, SampledGroup
from groupflow.rollout.engine import EngineSettings, RolloutEngine, engine_settings


class Generator:
    def __init__(self, settings: EngineSettings, device: Device, cores: list[int]):
        pin_to_cores(cores)  # before vLLM starts its threads, which inherit it
        self.engine = RolloutEngine(settings)
        self.device = device
        self.weight_group = None

    def sample(
        self, prompts: list[Prompt], group_size: int, sampling: SamplingConfig
    ) -> list[SampledGroup]:
        return self.engine.sample_groups(prompts, group_size, sampling)

    def complete(
        self, prompts: list[Prompt], n: int, sampling: SamplingConfig, greedy: bool
    ) -> list[SampledGroup]:
        return self.engine.complete(prompts, n, sampling, greedy)

    def load_weights(self, named_tensors, version: int) -> int:
        self.engine.load_weights(named_tensors, version)
        return version

    def begin_weights(self) -> None:
        """A streamed sync starts: buckets follow (add_weights), then finish_weights."""
        self._buckets: list[ray.ObjectRef] = []

    def add_weights(self, bucket: list[ray.ObjectRef]) -> None:
        """Note the next bucket's reference (wrapped in a list, so Ray does not fetch it yet)."""
        self._buckets.extend(bucket)

    def finish_weights(self, version: int) -> int:
        """Load the streamed buckets in one vLLM pass, fetching one bucket at a time."""
        buckets, self._buckets = self._buckets, []

        def fetched():
            while buckets:
                yield from ray.get(buckets.pop(0))

        self.engine.load_weights(fetched(), version)
        return version

    def open_weight_group(self, host: str, port: int, rank: int, world_size: int) -> None:
        self.weight_group = open_weight_group(host, port, rank, world_size, self.device.backend)

    def receive_weights(self, manifest, version: int) -> int:
        self.engine.receive_weights(self.weight_group, manifest, version, self.device.kind)
        return version

    def parameters_snapshot(self) -> dict:
        return self.engine.parameters_snapshot()


def chunk_size(num_prompts: int, num_engines: int) -> int:
    """About two chunks per engine: the first chunks are scored while the second generate."""
    return max(1, num_prompts // (2 * num_engines))


@dataclass
class _Chunk:
    rollout_id: int
    engine: int
    actor: object  # the engine it was sent to (its slot may hold a replacement since)
    prompts: list[Prompt]


class GeneratorPool:
    """The engines as one pool (groupflow.peers.Generation)."""

    def __init__(
        self,
        engines: list,
        futures: Futures,
        group_size: int,
        sampling: SamplingConfig,
        start_engine: Callable[[int], object] | None = None,
    ):
        self.engines = engines  # the weight transport loads the engines of this same list
        self.futures = futures
        self.group_size = group_size
        self.sampling = sampling
        self.start_engine = start_engine  # a new actor for slot i; None: deaths are fatal
        self.restarts = 0
        self._outstanding = [0] * len(engines)  # prompts sent to each engine, not yet taken
        self._chunks: dict[Handle, _Chunk] = {}
        self._unloaded: set[int] = set()  # slots whose replacement awaits the weights
        self._lost: dict[Handle, _Chunk] = {}  # chunks of dead engines, to generate again

    @property
    def num_engines(self) -> int:
        return len(self.engines)

    def submit(self, prompts: list[Prompt], rollout_id: int) -> list[Handle]:
        size = chunk_size(len(prompts), len(self.engines))
        return [
            self._send(_Chunk(rollout_id, -1, None, prompts[start : start + size]))
            for start in range(0, len(prompts), size)
        ]

    def _send(self, chunk: _Chunk) -> Handle:
        ready = [e for e in range(len(self.engines)) if e not in self._unloaded]
        chunk.engine = min(ready, key=self._outstanding.__getitem__)
        chunk.actor = self.engines[chunk.engine]
        self._outstanding[chunk.engine] += len(chunk.prompts)
        handle = chunk.actor.sample.remote(chunk.prompts, self.group_size, self.sampling)
        self._chunks[handle] = chunk
        return handle

    def in_flight(self) -> list[Handle]:
        return list(self._chunks)

    def take(self, ready: Sequence[Handle]) -> list[GeneratedChunk]:
        taken = []
        for handle in [h for h in ready if h in self._chunks]:
            chunk = self._chunks.pop(handle)
            self._outstanding[chunk.engine] -= len(chunk.prompts)
            try:
                (groups,) = self.futures.get([handle])
            except PeerDied:
                if self.start_engine is None:
                    raise
                self._lose(handle, chunk)
                continue
            taken.append(GeneratedChunk(chunk.rollout_id, groups))
        return taken

    def _lose(self, handle: Handle, chunk: _Chunk) -> None:
        self._lost[handle] = chunk
        if self.engines[chunk.engine] is chunk.actor:  # not replaced yet
            self._replace(chunk.engine)

    def _replace(self, slot: int) -> None:
        self.engines[slot] = self.start_engine(slot)
        self._unloaded.add(slot)
        self.restarts += 1

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

    def lost(self) -> set[Handle]:
        """Handles of the chunks lost with a dead engine and not yet sent again."""
        return set(self._lost)

    def drop_lost(self) -> None:
        """Forget the lost chunks: their rollouts were abandoned."""
        self._lost.clear()

    def needs_weights(self) -> bool:
        """A replacement waits for the current weights (and lost chunks wait for it)."""
        return bool(self._unloaded)

    def weights_sent(self) -> dict[Handle, Handle]:
        """Call once a weight load has been sent to every engine: replacements take work
        from now on (their calls run after the load). The lost chunks are sent again."""
        self._unloaded.clear()
        return self.resend_lost()

    def resend_lost(self) -> dict[Handle, Handle]:
        """Send the lost chunks again, to engines with the current weights (a chunk of a
        dead engine can fail after its replacement got them); each lost handle's new one."""
        resent = {old: self._send(chunk) for old, chunk in self._lost.items()}
        self._lost.clear()
        return resent

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

    def shutdown(self) -> None:
        for engine in self.engines:
            ray.kill(engine)


def start_generator_pool(cfg: Config, model_path: str) -> GeneratorPool:
    """`rollout.num_engines` generator actors, each placed by its declared resources; a dead
    one is replaced by a new actor with the same settings (with the object-store transport:
    the collective one's process group cannot take a new member, so a death ends the job)."""
    res = cfg.rollout.resources
    actor = ray.remote(Generator).options(
        num_cpus=res.num_cpus,
        num_gpus=res.num_gpus,
        resources=res.custom,
        runtime_env={
            "env_vars": {
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "OMP_NUM_THREADS": str(res.torch_threads),
            }
        },
    )
    device = device_for(res.num_gpus)

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
        start_engine if replaceable else None,
    )
