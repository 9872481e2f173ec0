"""The one place that knows about hardware: torch device, collective backend, DeepSpeed accelerator.

A config runs on CPU or GPU unchanged except for its resources: `num_gpus > 0` selects CUDA.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    kind: str  # "cpu" or "cuda"

    @property
    def backend(self) -> str:
        return "nccl" if self.kind == "cuda" else "gloo"

    def torch_device(self, local_rank: int = 0):
        import torch

        return torch.device(f"cuda:{local_rank}") if self.kind == "cuda" else torch.device("cpu")

    def engine_env(self) -> dict[str, str]:
        """Environment of an engine's process. On CPU, vLLM's sampler compiles its log-prob
        gather with torch.compile on the first sampled chunk: about 5 s of every engine
        start (and of every engine a job scales up) for a tiny op; engines run eager anyway
        (rollout/engine.py), so nothing else is compiled there."""
        return {"TORCHDYNAMO_DISABLE": "1"} if self.kind == "cpu" else {}

    def prepare_process(self) -> None:
        """Call before importing deepspeed: it picks its accelerator at import time."""
        os.environ.setdefault("DS_ACCELERATOR", self.kind)


def device_for(num_gpus: float) -> Device:
    return Device("cuda" if num_gpus > 0 else "cpu")
