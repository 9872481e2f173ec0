"""Fixtures of the pure-logic unit tests."""

import os

import pytest
import torch


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread():
    """The unit tests' models and batches are tiny: a second intra-op thread only adds its
    hand-offs, and on 2 cores shared with other work each op waits for it (a step of the
    learner's tests took 2-3 times as long on 2 threads). Restored for whatever runs after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def gen() -> torch.Generator:
    """A generator on a fresh seed; the seed is printed, so pytest shows it on failure."""
    seed = int(os.environ.get("GROUPFLOW_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"seed={seed} (rerun with GROUPFLOW_TEST_SEED={seed})")
    return torch.Generator().manual_seed(seed)
