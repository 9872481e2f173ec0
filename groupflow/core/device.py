"""The one place that knows about hardware: torch device, collective backend, DeepSpeed accelerator.

A config runs on CPU or GPU unchanged except for its resources: `num_gpus > 0` selects CUDA.
"""

from __future__ import annotations

import os
import sys
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
        if self.kind == "cpu":
            # DeepSpeed's CPU collective op is compiled on first use by torch's extension
            # builder. `make setup` builds it into the environment; find that copy, and check
            # it with the environment's ninja: another ninja reads the build log as stale and
            # rebuilds (a minute on 2 cores), as a job started without the venv on PATH did.
            os.environ.setdefault(
                "TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions")
            )
            bin_dir = os.path.dirname(sys.executable)
            os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])


def device_for(num_gpus: float) -> Device:
    return Device("cuda" if num_gpus > 0 else "cpu")


def to_device(tensor, device):
    """`tensor` (on the host) on `device`, without stalling the host: a copy from pageable
    memory to a GPU waits for the copy to finish; from pinned memory it is queued on the
    stream like a kernel. The pinned buffer comes from torch's caching host allocator, which
    keeps it until the copy is done."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
