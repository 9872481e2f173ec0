"""A weight sync of a mixture-of-experts model, loaded into the layout its expert kernel reads.

vLLM (0.32) reloads a layer in place by building a fresh copy of it, loading the new weights
into that copy, running the layer's load-time processing on it and copying the result into the
tensors the engine computes with. For unquantized experts that processing differs on a reload
from a first load: `UnquantizedFusedMoEMethod` sees its kernel already built and skips the
kernel's own step (`fused_experts.process_weights_after_loading`). On CPU that step pads the
expert width to the kernel's alignment and repacks gate/up and down into the grouped GEMM's
blocked layout, so the plain [experts, out, in] weights were copied into storage the kernel
reads as packed: every sync scrambled every expert of every layer, whatever the model family
(on groupflow/run/small_moe.py's model, 2.75 nats of mean log-prob error against 4e-7 with this
module), or failed on an expert width that needs padding. The checksums of the tensors handed
over still matched: only the sync probe (groupflow/core/sync_probe.py) sees such a thing.

`expert_kernels_processed` makes such a layer's reload process it as a first load does, for
any MoE model, and only where the kernel has a step of its own to skip (GPU kernels without
one keep vLLM's in-place path untouched).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def _skipped_on_reload(method) -> bool:
    """Whether `method` (a layer's quant_method) is unquantized experts whose built kernel has
    a load-time step of its own, which vLLM skips on a reload."""
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    kernel = getattr(method, "moe_kernel", None)
    if not isinstance(method, UnquantizedFusedMoEMethod) or kernel is None:
        return False
    step = type(kernel.fused_experts).process_weights_after_loading
    return step is not FusedMoEExperts.process_weights_after_loading


@contextmanager
def expert_kernels_processed(model: torch.nn.Module) -> Iterator[int]:
    """For the time of a reload of `model`, each expert layer whose kernel step vLLM would skip
    is processed with no kernel built, as on its first load: the step runs on the layer's fresh
    copy, whose processed tensors vLLM then copies into the engine's. The layer keeps the kernel
    it had (the one built meanwhile is dropped), so nothing the engine holds changes but the
    values of its tensors. Yields the number of such layers."""
    methods = [
        m
        for m in (getattr(module, "quant_method", None) for module in model.modules())
        if _skipped_on_reload(m)
    ]
    for method in methods:
        method.process_weights_after_loading = _as_first_load(method)
    try:
        yield len(methods)
    finally:
        for method in methods:
            del method.process_weights_after_loading  # the class's own again


def _as_first_load(method):
    process = type(method).process_weights_after_loading

    def process_as_first_load(layer: torch.nn.Module) -> None:
        kept = method.moe_kernel
        method.moe_kernel = None
        try:
            process(method, layer)
        finally:
            method.moe_kernel = kept

    return process_as_first_load
