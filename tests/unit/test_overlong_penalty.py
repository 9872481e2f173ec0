"""DAPO's soft overlong punishment: zero, then a linear ramp to -max_penalty at the limit."""

import random

import pytest
import torch

from groupflow.learner.advantages import overlong_penalty


def test_penalty_is_zero_then_linear_down_to_the_cap():
    rng = random.Random()
    max_tokens = rng.randint(8, 4096)
    buffer = rng.randint(1, max_tokens - 1)
    cap = rng.uniform(0.1, 2.0)
    lengths = torch.tensor([rng.randint(0, max_tokens) for _ in range(300)] + [max_tokens])
    got = overlong_penalty(lengths, max_tokens, buffer, cap)
    free = max_tokens - buffer
    for n, p in zip(lengths.tolist(), got.tolist(), strict=True):
        expected = 0.0 if n <= free else -cap * (n - free) / buffer
        assert p == pytest.approx(expected, abs=1e-12)
    assert got[-1].item() == pytest.approx(-cap)
    assert got.dtype == torch.float64 and (got <= 0).all() and (got >= -cap).all()
