"""The mixture-of-experts blocks of a Hugging Face model, and their ZeRO-3 handling.

A block is the module that holds one layer's experts as its `experts` child, beside its router
(transformers' Qwen3-MoE, Qwen2-MoE, Mixtral, GPT-OSS and DeepSeek blocks all do). ZeRO-3
gathers a module's parameters from a hook on the module that owns them; in a block, which
children run and in what order follows the routing, so ZeRO-3's trace of the forward, on which
its prefetching rests, changes with the tokens, and an expert module no token reached leaves
its parameters out of one rank's forward but not another's. As a leaf module a block is hooked
once: all its parameters are gathered when it runs, whatever the routing.
"""

from __future__ import annotations

import torch


def moe_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of `model` that hold a layer's experts (none in a dense model)."""
    return [m for m in model.modules() if isinstance(getattr(m, "experts", None), torch.nn.Module)]


def make_leaf_modules(model: torch.nn.Module) -> int:
    """Make each mixture-of-experts block of `model` a ZeRO-3 leaf module (before
    deepspeed.initialize hooks it); the number of blocks."""
    blocks = moe_blocks(model)
    if blocks:
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, sorted({type(b) for b in blocks}, key=lambda t: t.__name__))
    return len(blocks)


def config_has_experts(model_path: str) -> bool:
    """Whether the config at `model_path` counts experts (every MoE config of transformers
    names them: num_experts, num_local_experts, n_routed_experts)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path).get_text_config()
    return any(
        getattr(config, key, None)
        for key in ("num_experts", "num_local_experts", "n_routed_experts")
    )
