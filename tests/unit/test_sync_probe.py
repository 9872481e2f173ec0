"""The sync probe (groupflow/core/sync_probe.py): drawing it, comparing an engine's log-probs of it
with the learner's in float64, the tolerance by dtype and the one line of a mismatch; and the
learner's side (learner/probe.py) on a mixture of experts."""

from __future__ import annotations

import math

import pytest
import torch

from groupflow.core.random_model import random_causal_lm
from groupflow.core.sync_probe import (
    PROBE_SEQUENCES,
    PROBE_TOLERANCE,
    SyncProbeMismatch,
    check_probe,
    compare_probe,
    draw_probe,
    job_probe,
    probe_figures,
    probe_length,
    probe_vocabulary,
)
from groupflow.core.weight_format import WeightSyncMismatch
from groupflow.learner.probe import probe_logprobs
from groupflow.learner.token_head import install_token_head
from groupflow.run.quickstart import build_tokenizer
from groupflow.run.small_moe import ARCHITECTURE, SHAPE


def test_the_probe_is_drawn_from_the_seed_alone_within_the_vocabulary():
    probe = draw_probe(50, seed=7, length=9)
    assert probe == draw_probe(50, seed=7, length=9), "both sides draw the same probe"
    assert probe != draw_probe(50, seed=8, length=9)
    assert len(probe) == PROBE_SEQUENCES and {len(s) for s in probe} == {9}
    assert all(0 <= t < 50 for s in probe for t in s)


def test_a_probe_sequence_leaves_the_engine_one_token_to_sample():
    assert probe_length(4096) == 32
    assert probe_length(20) == 19
    assert probe_length(2) == 2  # still one token to score


def test_the_vocabulary_is_what_both_the_embedding_and_the_tokenizer_hold(tmp_path):
    random_causal_lm(40, seed=0).save_pretrained(tmp_path / "no_tokenizer")
    assert probe_vocabulary(str(tmp_path / "no_tokenizer")) == 40  # a learner-only model
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    for rows in (len(tokenizer) + 13, len(tokenizer) - 5):
        random_causal_lm(rows, seed=0).save_pretrained(tmp_path)
        assert probe_vocabulary(str(tmp_path)) == min(rows, len(tokenizer))
    probe = job_probe(str(tmp_path), seed=3, max_model_len=12)
    assert probe == draw_probe(len(tokenizer) - 5, 3, 11)


def random_logprobs(gen: torch.Generator, probe) -> list[list[float]]:
    return [
        (-10 * torch.rand(len(s) - 1, generator=gen, dtype=torch.float64)).tolist() for s in probe
    ]


def test_identical_log_probs_agree_exactly(gen):
    probe = draw_probe(40, 0, 10)
    learner = random_logprobs(gen, probe)
    agreement = compare_probe(probe, [list(s) for s in learner], learner)
    assert agreement.mean == agreement.max == 0.0
    check_probe(agreement, "float32", "engine 0", 3)


def test_the_comparison_is_float64_and_finds_the_worst_token(gen):
    probe = draw_probe(40, 1, 10)
    learner = random_logprobs(gen, probe)
    engine = [list(s) for s in learner]
    # differences float32 could not hold on numbers of this size (its spacing near 10 is 1e-6)
    engine[0][3] += 3e-12
    engine[2][7] += 5e-12
    engine[3][0] -= 1e-12
    a = compare_probe(probe, engine, learner)
    tokens = len(probe) * (len(probe[0]) - 1)
    assert a.max == pytest.approx(5e-12, rel=1e-3)
    assert a.mean == pytest.approx(9e-12 / tokens, rel=1e-3)
    assert (a.sequence, a.position, a.token) == (2, 8, probe[2][8])
    assert (a.engine, a.learner) == (engine[2][7], learner[2][7])


def test_a_missing_or_non_finite_log_prob_is_infinitely_far(gen):
    probe = draw_probe(40, 2, 6)
    learner = random_logprobs(gen, probe)
    short = [list(s) for s in learner]
    short[1] = short[1][:-1]  # the engine scored one token less
    a = compare_probe(probe, short, learner)
    assert math.isinf(a.max) and (a.sequence, a.position) == (1, 5) and math.isnan(a.engine)
    nan = [list(s) for s in learner]
    nan[0][2] = math.nan
    assert math.isinf(compare_probe(probe, nan, learner).max)
    with pytest.raises(SyncProbeMismatch):
        check_probe(a, "bfloat16", "engine 0", 1)
    with pytest.raises(ValueError, match="4 sequences, the engine scored 3"):
        compare_probe(probe, short[:3], learner)


@pytest.mark.parametrize("dtype", sorted(PROBE_TOLERANCE))
def test_the_tolerance_is_the_dtypes_on_the_mean_and_on_each_token(gen, dtype):
    mean_bound, max_bound = PROBE_TOLERANCE[dtype]
    probe = draw_probe(40, 3, 5)  # 16 tokens
    learner = random_logprobs(gen, probe)

    def shifted(by: list[float]) -> list[list[float]]:
        flat = iter(by)
        return [[x + next(flat, 0.0) for x in s] for s in learner]

    within = compare_probe(probe, shifted([mean_bound * 0.9] * 16), learner)
    check_probe(within, dtype, "engine 0", 1)
    spread = compare_probe(probe, shifted([mean_bound * 1.1] * 16), learner)  # every token off
    one = compare_probe(probe, shifted([max_bound * 1.1]), learner)  # a single token far off
    for off in (spread, one):
        with pytest.raises(SyncProbeMismatch):
            check_probe(off, dtype, "engine 0", 1)


def test_a_mismatch_is_one_line_naming_engine_version_and_worst_token():
    probe = [[3, 4, 5, 6]]
    a = compare_probe(probe, [[-1.0, -2.5, -3.0]], [[-1.0, -2.0, -3.0]])
    with pytest.raises(WeightSyncMismatch) as err:  # stopped like any failed load
        check_probe(a, "float32", "engine 1 (actor 0123456789ab)", 7)
    line = str(err.value)
    assert "\n" not in line
    assert line == (
        "weight sync of policy version 7: engine 1 (actor 0123456789ab) computes other "
        "log-probs than the learner with it: sync probe |difference| mean 0.167 and max 0.5 "
        "nats (a float32 sync allows 0.0001 and 0.01); worst at token 2 (id 5) of probe "
        "sequence 0: engine -2.5, learner -2"
    )
    assert err.value.exit_code == 1


def test_the_records_figures_are_the_worst_loads():
    probe = [[1, 2, 3]]
    a = compare_probe(probe, [[-1.0, -1.0]], [[-1.0, -1.5]])  # mean 0.25, max 0.5
    b = compare_probe(probe, [[-1.3, -1.3]], [[-1.0, -1.0]])  # mean 0.3, max 0.3
    assert probe_figures([]) == {}
    figures = probe_figures([a, b])
    assert figures["sync_probe_diff_mean"] == pytest.approx(0.3)
    assert figures["sync_probe_diff_max"] == pytest.approx(0.5)


@pytest.mark.parametrize("packed", [True, False])
def test_the_learners_side_is_the_models_log_probs_on_a_mixture_of_experts(gen, packed):
    """learner/probe.py through the token head, as a rank takes it, against a plain float64
    forward of the small Qwen3-MoE's architecture, packed or one row per sequence."""
    torch.set_num_threads(1)
    seed = int(torch.randint(0, 2**31, (), generator=gen))
    model = random_causal_lm(64, architecture=ARCHITECTURE, seed=seed, **SHAPE).double().eval()
    model.set_experts_implementation("eager")  # torch's grouped GEMM takes no float64
    probe = draw_probe(64, seed, 12)
    with torch.no_grad():
        want = [
            model(torch.tensor([s])).logits[0, :-1].log_softmax(-1)[range(11), s[1:]].tolist()
            for s in probe
        ]
    install_token_head(model)
    got = probe_logprobs(model, probe, torch.device("cpu"), packed)
    assert compare_probe(probe, got, want).max < 1e-12
