"""Generator actors (vLLM engines that sample groups and load new weights between requests)
and the pool that spreads a rollout over them.

The pool is the twin of the reward pool (actors/reward.py): it sends each chunk of prompts to
the engine with the least outstanding work and hands chunks on as they finish, so scoring
starts while later chunks still generate. An engine runs its calls in the order they were
sent, so a weight load sent after a chunk is applied after that chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import ray

from groupflow.actors.futures import RayFutures
from groupflow.actors.weight_group import open_weight_group
from groupflow.config import Config, SamplingConfig
from groupflow.learner.device import Device, device_for
from groupflow.peers import Futures, GeneratedChunk, Handle
from groupflow.records import Prompt, SampledGroup
from groupflow.rollout.engine import EngineSettings, RolloutEngine, engine_settings


class Generator:
    def __init__(self, settings: EngineSettings, device: Device):
        self.engine = RolloutEngine(settings)
        self.device = device
        self.weight_group = None

    def sample(
        self, prompts: list[Prompt], group_size: int, sampling: SamplingConfig
    ) -> list[SampledGroup]:
        return self.engine.sample_groups(prompts, group_size, sampling)

    def greedy(self, prompts: list[Prompt], max_tokens: int) -> list[str]:
        return self.engine.greedy(prompts, max_tokens)

    def load_weights(self, named_tensors, version: int) -> int:
        self.engine.load_weights(named_tensors, version)
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
    prompts: int


class GeneratorPool:
    """The engines as one pool (groupflow.peers.Generation)."""

    def __init__(self, engines: list, futures: Futures, group_size: int, sampling: SamplingConfig):
        self.engines = engines
        self.futures = futures
        self.group_size = group_size
        self.sampling = sampling
        self._outstanding = [0] * len(engines)  # prompts sent to each engine, not yet taken
        self._chunks: dict[Handle, _Chunk] = {}

    @property
    def num_engines(self) -> int:
        return len(self.engines)

    def submit(self, prompts: list[Prompt], rollout_id: int) -> list[Handle]:
        size = chunk_size(len(prompts), len(self.engines))
        handles = []
        for start in range(0, len(prompts), size):
            part = prompts[start : start + size]
            e = min(range(len(self.engines)), key=self._outstanding.__getitem__)
            self._outstanding[e] += len(part)
            handle = self.engines[e].sample.remote(part, self.group_size, self.sampling)
            self._chunks[handle] = _Chunk(rollout_id, e, len(part))
            handles.append(handle)
        return handles

    def in_flight(self) -> list[Handle]:
        return list(self._chunks)

    def take(self, ready: Sequence[Handle]) -> list[GeneratedChunk]:
        mine = [h for h in ready if h in self._chunks]
        groups = self.futures.get(mine) if mine else []
        taken = []
        for handle, chunk_groups in zip(mine, groups, strict=True):
            chunk = self._chunks.pop(handle)
            self._outstanding[chunk.engine] -= chunk.prompts
            taken.append(GeneratedChunk(chunk.rollout_id, chunk_groups))
        return taken

    def queued_prompts(self) -> int:
        return sum(self._outstanding)

    def greedy(self, prompts: list[Prompt], max_tokens: int) -> list[str]:
        n = len(self.engines)
        shards = self.futures.get(
            [e.greedy.remote(prompts[i::n], max_tokens) for i, e in enumerate(self.engines)]
        )
        texts: list[str] = [""] * len(prompts)
        for i, shard in enumerate(shards):
            texts[i::n] = shard
        return texts

    def shutdown(self) -> None:
        for engine in self.engines:
            ray.kill(engine)


def start_generator_pool(cfg: Config, model_path: str) -> GeneratorPool:
    """`rollout.num_engines` generator actors, each placed by its declared resources."""
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
    engines = [
        actor.remote(engine_settings(cfg, model_path, seed=cfg.trainer.seed + i), device)
        for i in range(cfg.rollout.num_engines)
    ]
    return GeneratorPool(engines, RayFutures(), cfg.rollout.group_size, cfg.rollout.sampling)
