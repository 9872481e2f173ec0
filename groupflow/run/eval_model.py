"""What `groupflow eval` evaluates, checked before anything heavy is imported: a model
directory, or a LoRA adapter whose matrices fit its base. A refusal here is one line within
seconds, where the engine's module (vLLM, Ray's tool sandboxes) would take most of a CPU-minute
to import first."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from groupflow.config import Config
from groupflow.core.adapters import SavedAdapter, is_adapter_dir, read_adapter_dir
from groupflow.core.model_dir import check_tensor_parallel, read_model_config
from groupflow.run.job_config import check_resolved


@dataclass
class EvalModel:
    path: str  # as the user named it (printed back)
    base: str  # the model directory the engine loads
    adapter: SavedAdapter | None  # served on `base` where given
    tensors: list[tuple[str, torch.Tensor]] | None  # the adapter's matrices, checked


def eval_model(cfg: Config, model_path: str) -> EvalModel:
    """`model_path` checked against `cfg`: a resolved config, the adapter's matrices against
    its base, the base's shape against the tensor-parallel size."""
    check_resolved(cfg)
    adapter = read_adapter_dir(model_path) if is_adapter_dir(model_path) else None
    base = model_path if adapter is None else adapter.base
    check_tensor_parallel(cfg.rollout.tensor_parallel_size, read_model_config(base), base)
    tensors = None if adapter is None else adapter.tensors()
    return EvalModel(model_path, base, adapter, tensors)
