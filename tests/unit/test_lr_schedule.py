"""The learning-rate schedule: warmup then constant, linear or cosine decay, per training step.
Checked against transformers' schedulers, whose shapes it follows."""

import random

import pytest
import torch
from transformers import get_scheduler

from groupflow.config import OptimizerConfig
from groupflow.learner.lr_schedule import lr_at

TRANSFORMERS_NAMES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_rates_follow_transformers_schedule_and_never_reach_zero(kind):
    rng = random.Random()
    total = rng.randint(2, 300)
    warmup = rng.randint(0, total)
    cfg = OptimizerConfig(lr=10 ** rng.uniform(-7, -3), lr_schedule=kind, warmup_steps=warmup)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    reference = get_scheduler(
        TRANSFORMERS_NAMES[kind], optimizer, num_warmup_steps=warmup, num_training_steps=total + 1
    ).lr_lambdas[0]

    rates = [lr_at(cfg, step, total) for step in range(1, total + 1)]
    assert rates == pytest.approx([cfg.lr * reference(s) for s in range(1, total + 1)], rel=1e-12)
    assert min(rates) > 0  # the first and the last step learn
    assert max(rates) <= cfg.lr * (1 + 1e-12)
    decaying = rates[max(warmup, 1) - 1 :]
    assert all(a >= b for a, b in zip(decaying, decaying[1:], strict=False))


@pytest.mark.parametrize("bad", [{"lr_schedule": "exponential"}, {"warmup_steps": -1}])
def test_bad_schedule_settings_are_refused(bad):
    with pytest.raises(ValueError):
        OptimizerConfig(**bad)
