"""Runs inside vLLM's worker (via `worker_extension_cls`): loads new weights in place."""

from __future__ import annotations

import torch


class WeightReceiver:
    """Mixed into vLLM's worker class; reached with `llm.collective_rpc(name, args=...)`."""

    def load_named_tensors(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        # reload_weights maps Hugging Face names onto vLLM's fused layers (qkv, gate_up),
        # the same path as loading a checkpoint, so no name mapping lives here.
        self.model_runner.reload_weights(weights_iterator=iter(named_tensors))
        return len(named_tensors)

    def named_parameters_snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of the engine's parameters in vLLM's own layout (for sync checks)."""
        model = self.model_runner.get_model()
        return {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
