"""Fixtures of the pure-logic unit tests."""

import os

import pytest
import torch


@pytest.fixture
def gen() -> torch.Generator:
    """A generator on a fresh seed; the seed is printed, so pytest shows it on failure."""
    seed = int(os.environ.get("GROUPFLOW_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"seed={seed} (rerun with GROUPFLOW_TEST_SEED={seed})")
    return torch.Generator().manual_seed(seed)
