"""Randomly initialised causal LMs of a given shape: the quickstart's model before its warm
start, and the models of the tests and benchmarks.

One builder, so that a shape is written as the Hugging Face config keys that differ from
SMALL_SHAPE (a 2-layer model of a few thousand parameters, quick on any CPU) and nothing else.
"""

from __future__ import annotations

from typing import Any

import torch

SMALL_SHAPE: dict[str, Any] = dict(
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
)


def random_causal_lm(
    vocab_size: int, *, architecture: str = "qwen2", seed: int | None = None, **config: Any
) -> torch.nn.Module:
    """A random-init `Qwen2ForCausalLM` (or `LlamaForCausalLM`, or the mixture of experts
    `Qwen3MoeForCausalLM`) of SMALL_SHAPE with `config`'s keys (any key of the architecture's
    config class) over it; seeded with torch.manual_seed when `seed` is given, so that the
    caller's later draws follow from it too."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    classes = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    }
    if architecture not in classes:
        raise ValueError(f"architecture {architecture!r}: choose one of {sorted(classes)}")
    config_class, model_class = classes[architecture]
    if seed is not None:
        torch.manual_seed(seed)
    return model_class(config_class(vocab_size=vocab_size, **{**SMALL_SHAPE, **config}))
