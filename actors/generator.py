"""Generator actors: vLLM engines that sample groups and load new weights between requests."""

from __future__ import annotations

import ray

from groupflow.collective import open_weight_group
from groupflow.config import Config
from groupflow.records import Prompt, SampledGroup
from groupflow.learner.device import Device, device_for
from groupflow.rollout.engine import (
    EngineSettings,
    RolloutEngine,
    SamplingSettings,
    engine_settings,
)


class Generator:
    def __init__(self, settings: EngineSettings, device: Device):
        self.engine = RolloutEngine(settings)
        self.device = device
        self.weight_group = None

    def sample(
        self, prompts: list[Prompt], group_size: int, sampling: SamplingSettings
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


def start_generators(cfg: Config, model_path: str) -> list:
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
    return [
        actor.remote(engine_settings(cfg, model_path, seed=cfg.trainer.seed + i), device)
        for i in range(cfg.rollout.num_engines)
    ]
