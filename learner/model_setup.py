"""A freshly loaded Hugging Face causal LM made ready for a learner rank."""

from __future__ import annotations

import torch

from groupflow.config.learner import LearnerConfig
from groupflow.learner.moe_blocks import make_leaf_modules
from groupflow.learner.routing_replay import install_routing_replay
from groupflow.learner.token_head import TokenHead, install_token_head


def prepare_model(model: torch.nn.Module, cfg: LearnerConfig, trainable: bool = True) -> TokenHead:
    """Call before deepspeed.initialize: no KV cache, the token head (learner/token_head.py),
    a mixture of experts' blocks as ZeRO-3 leaf modules (learner.moe.leaf_modules), its
    routers hooked for routing replay and the routing disagreement (learner/routing_replay.py;
    counted on the trained model only) and, for a model that is trained, activation
    checkpointing of its transformer layers."""
    model.config.use_cache = False
    if cfg.moe.leaf_modules:
        make_leaf_modules(model)
    install_routing_replay(model, cfg.moe.routing_replay == "rollout", counting=trainable)
    if trainable and cfg.gradient_checkpointing == "auto":
        raise ValueError("learner.gradient_checkpointing: auto is decided by the rank first")
    if trainable and cfg.gradient_checkpointing:
        # Non-reentrant checkpointing recomputes inside autograd, so ZeRO-3's hooks gather
        # each layer's parameters again for the recomputation, and inputs need no grad.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return install_token_head(model)
