"""Full parameters out of a ZeRO-3 engine, one parameter gathered at a time: to rank 0's
memory, to a broadcast group of inference engines, or to a Hugging Face directory.

All functions are collective: every rank gathers each parameter together, in the order of
`module.named_parameters()`, and only the source rank (rank 0) keeps or sends it.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Broadcaster(Protocol):
    """A process group in which this rank is the source of a broadcast."""

    def broadcast(self, tensor: torch.Tensor) -> None: ...


def gathered_weights(module, is_source: bool) -> list[tuple[str, torch.Tensor]] | None:
    """Full parameters in Hugging Face names on the source rank (None elsewhere)."""
    import deepspeed

    out = []
    for name, param in module.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            if is_source:
                out.append((name, param.detach().to("cpu", copy=True)))
    return out if is_source else None


def weight_manifest(module) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, full shape, dtype) of every parameter, in broadcast order. Local: no gather."""
    return [
        (name, tuple(getattr(p, "ds_shape", p.shape)), str(p.dtype).removeprefix("torch."))
        for name, p in module.named_parameters()
    ]


def broadcast_weights(module, group: Broadcaster | None) -> None:
    """Gather each parameter and, where `group` is given (the source rank), broadcast it to
    the engines one tensor at a time, never holding a full copy of the model."""
    import deepspeed

    for _, param in module.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            if group is not None:
                group.broadcast(param.data.contiguous())


def save_pretrained(module, is_source: bool, path: str) -> None:
    """The current policy in Hugging Face format, written by the source rank."""
    weights = gathered_weights(module, is_source)
    if weights is not None:
        module.save_pretrained(path, state_dict=dict(weights))
