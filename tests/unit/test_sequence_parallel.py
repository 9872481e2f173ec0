"""Ulysses sequence parallelism (learner/sequence_parallel.py): a learner step at
learner.sequence_parallel_size 2 and 4 gives size 1's loss and gradients, to 1e-10 of each
parameter's largest gradient, for every preset, packed and padded, with observation tokens,
row widths that the size does not divide, LoRA and gradient checkpointing; with data
parallelism over the groups at size 2. Four gloo ranks in spawned processes
(tests/unit/sequence_parallel_ranks.py)."""

from __future__ import annotations

import multiprocessing
import socket

import pytest

from tests.unit.sequence_parallel_ranks import WORLD, Case, run_rank
from tests.unit.test_learner_step import CASES

TOLERANCE = 1e-10

SP_CASES = [
    Case(f"{p.id}-{'packed' if i % 2 == 0 else 'padded'}", *p.values, i % 2 == 0, i % 3 == 0)
    for i, p in enumerate(CASES)
] + [
    Case("grpo-lora-packed", "grpo", {}, True, True, lora=True),
    Case("dfpo-lora-padded-checkpointing", "dfpo", {}, False, False, lora=True, checkpointing=True),
    Case("lopti-padded", "lopti", {}, False, True),
    Case("stapo-packed-checkpointing", "stapo", {}, True, False, checkpointing=True),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks_results(request) -> list[dict]:
    """Every case on four ranks at once; each rank's comparisons."""
    seed = 1000 + request.config.getoption("randomly_seed", default=0) if False else 1000
    port = _free_port()
    with multiprocessing.get_context("spawn").Pool(WORLD) as pool:
        return pool.starmap(run_rank, [(r, port, SP_CASES, seed) for r in range(WORLD)])


@pytest.mark.parametrize("case", SP_CASES, ids=lambda c: c.name)
def test_sequence_parallel_gives_the_loss_and_gradients_of_one_rank(ranks_results, case):
    for rank, results in enumerate(ranks_results):
        result = results[case.name]
        for size in (2, 4):
            got = result[size]
            assert got["grad_scale"] > 0, "the step must have a gradient"
            assert got["grad_error"] <= TOLERANCE, (rank, size, got)
            assert got["loss"] == pytest.approx(got["loss_one"], rel=TOLERANCE, abs=1e-14)
    assert set(ranks_results[0][case.name]["widths_not_dividing"]) - {0}, "lengths % 4 != 0"
