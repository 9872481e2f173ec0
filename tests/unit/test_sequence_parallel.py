"""Ulysses sequence parallelism (learner/sequence_parallel.py): a learner step at
learner.sequence_parallel_size 2 and 4 gives size 1's loss and gradients, to 1e-10 of each
parameter's largest gradient, for every preset, packed and padded, with observation tokens,
row widths that the size does not divide, LoRA and gradient checkpointing; with data
parallelism over the groups at size 2. Four gloo ranks in processes of their own
(tests/unit/sequence_parallel_ranks.py)."""

from __future__ import annotations

import json
import multiprocessing
import socket

import pytest

from groupflow.config import ConfigError
from groupflow.learner.sequence_parallel import check_heads
from groupflow.run.inputs import check_sequence_parallel
from groupflow.run.job_config import build_config
from tests.unit.sequence_parallel_ranks import PRELOAD, WORLD, Case, run_rank
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
def ranks_results() -> list[dict]:
    """Every case on four ranks at once; each rank's comparisons."""
    seed = 1000
    port = _free_port()
    # Fresh processes (no threads or state of this one), forked from a server that has
    # imported what they need (PRELOAD: seconds of CPU each)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    with context.Pool(WORLD) as pool:
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


def test_a_size_that_does_not_divide_the_ranks_is_refused_in_one_line():
    with pytest.raises(ConfigError) as err:
        build_config({"learner": {"num_ranks": 3, "sequence_parallel_size": 2}})
    message = str(err.value)
    assert "\n" not in message and "sequence_parallel_size=2" in message, message
    assert build_config({"learner": {"num_ranks": 4, "sequence_parallel_size": 2}})


def test_a_size_that_does_not_divide_the_heads_is_refused_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 6}))
    cfg = build_config(
        {"model": {"path": str(tmp_path)}, "learner": {"num_ranks": 4, "sequence_parallel_size": 4}}
    )
    with pytest.raises(
        ConfigError,
        match=r"^learner\.sequence_parallel_size=4 does not divide "
        r"the 6 attention heads of ",
    ):
        check_sequence_parallel(cfg, str(tmp_path))
    check_heads(6, 2)  # divides: no error
