"""The learning rate of each training step: a linear warmup, then constant, or a linear or
cosine decay (`learner.optimizer.lr_schedule`), the shapes transformers' schedulers use.

A training step may make several optimizer updates (mini-batches, Lopti's passes), so the
schedule is keyed to the training step, not to the update count. The driver owns it and sends
each step's rate with the step: a resumed or rebuilt learner is back on schedule with no state
of its own.
"""

from __future__ import annotations

import math

from groupflow.config.learner import OptimizerConfig


def lr_at(cfg: OptimizerConfig, step: int, total_steps: int) -> float:
    """The rate of training step `step` (1-based) of `total_steps`: lr * step/W during a
    warmup of W steps, then the decay, which ends one step after the last (so the last step
    still learns)."""
    if step < cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / (total_steps + 1 - cfg.warmup_steps)
    factor = {
        "constant": 1.0,
        "linear": 1.0 - progress,
        "cosine": 0.5 * (1.0 + math.cos(math.pi * progress)),
    }[cfg.lr_schedule]
    return cfg.lr * factor
