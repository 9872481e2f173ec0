"""The off-policy correction of decoupled PPO (learner/off_policy.py) and how it composes with
the token credit (learner/credit.py) and the learner step (learner/step.py).

On fresh random inputs, float64: weights match a direct loop; mismatch-free samples give every
weight exactly 1 and the uncorrected update bit for bit; masks, thresholds and denominators
do not move; equal weights within a group keep the token gradient cancellation.
"""

from __future__ import annotations

import math
from dataclasses import astuple, replace

import pytest
import torch

from groupflow.config import ConfigError
from groupflow.config.presets import PRESETS
from groupflow.learner.credit import LocalReducer, plan_credit
from groupflow.learner.off_policy import importance_weights
from groupflow.learner.step import no_grad_stats
from groupflow.run.job_config import build_config
from tests.unit.test_credit import algorithm, pass_gradients, random_tokens
from tests.unit.test_learner_step import algorithm as preset_algorithm
from tests.unit.test_learner_step import layout, run_step, sample_step, settings, tiny_model

MODES = [
    {"mode": "tis", "level": "token", "cap": 1.5},
    {"mode": "tis", "level": "sequence", "cap": 1.2},
    {"mode": "mis", "level": "token", "band": [0.7, 1.4]},
    {"mode": "mis", "level": "sequence", "band": [0.5, 2.0]},
]
MODE_IDS = [f"{m['mode']}-{m['level']}" for m in MODES]


def loop_weights(tokens, cfg) -> tuple[list[list[float]], dict]:
    """w per valid token, row by row, and the figures, straight from the definitions."""
    weights, measured = [], []
    for row in range(tokens.mask.shape[0]):
        n = int(tokens.mask[row].sum())
        known = bool(tokens.behaviour_known[row])
        log_ratios = [
            (tokens.old_logp[row, t] - tokens.behaviour_logp[row, t]).item() if known else 0.0
            for t in range(n)
        ]
        if cfg.level == "sequence":
            log_ratios = [sum(log_ratios)] * n
        row_weights = []
        for t, lr in enumerate(log_ratios):
            ratio = math.exp(lr)
            w = ratio
            if cfg.mode == "tis":
                w = min(ratio, cfg.cap)
            elif cfg.mode == "mis" and not cfg.band[0] <= ratio <= cfg.band[1]:
                w = 0.0
            row_weights.append(w)
            if known:
                token_lr = (tokens.old_logp[row, t] - tokens.behaviour_logp[row, t]).item()
                kl = math.exp(token_lr) - token_lr - 1
                measured.append((ratio, ratio > cfg.cap, w == 0.0 and ratio != 0.0, kl))
        weights.append(row_weights)
    figures = {
        "tokens": len(measured),
        "weight": sum(m[0] for m in measured),
        "weight_max": max(m[0] for m in measured),
        "truncated": sum(m[1] for m in measured) if cfg.mode == "tis" else 0,
        "masked": sum(m[2] for m in measured) if cfg.mode == "mis" else 0,
        "kl": sum(m[3] for m in measured),
    }
    return weights, figures


@pytest.mark.parametrize("keys", MODES, ids=MODE_IDS)
def test_weights_and_figures_match_a_loop(gen, keys):
    tokens = random_tokens(gen)
    cfg = algorithm(off_policy=keys).off_policy
    got = importance_weights(
        tokens.old_logp, tokens.behaviour_logp, tokens.behaviour_known, tokens.mask, cfg
    )
    want, figures = loop_weights(tokens, cfg)
    for row, row_weights in enumerate(want):
        expected = torch.tensor(row_weights, dtype=torch.float64)
        torch.testing.assert_close(
            got.weight[row, : len(row_weights)], expected, rtol=1e-12, atol=0
        )
    assert got.figures.tokens == figures["tokens"]
    assert got.figures.truncated == figures["truncated"]
    assert got.figures.masked == figures["masked"]
    assert (got.figures.truncated or got.figures.masked) > 0, "the case must bound some weight"
    for name in ("weight", "weight_max", "kl"):
        assert getattr(got.figures, name) == pytest.approx(figures[name], rel=1e-12), name
    assert not got.weight.requires_grad


def test_mode_none_applies_no_weight_but_measures(gen):
    tokens = random_tokens(gen)
    cfg = algorithm().off_policy
    got = importance_weights(
        tokens.old_logp, tokens.behaviour_logp, tokens.behaviour_known, tokens.mask, cfg
    )
    assert got.weight is None
    _, figures = loop_weights(tokens, cfg)
    assert got.figures.weight == pytest.approx(figures["weight"], rel=1e-12)
    assert got.figures.kl == pytest.approx(figures["kl"], rel=1e-12) and got.figures.kl > 0


# ----- composition with the token credit -------------------------------------------------------

CREDIT_CASES = [{}] + [{key: value} for key, value in PRESETS.items() if value]


@pytest.mark.parametrize(
    "credit", CREDIT_CASES, ids=["grpo", *(k for k, v in PRESETS.items() if v)]
)
def test_mismatch_free_samples_give_the_uncorrected_plan_bit_for_bit(gen, credit):
    preset = next(iter(credit), "grpo")
    tokens = random_tokens(gen, off_policy=False)  # behaviour = proximal = current
    base = plan_credit(tokens, algorithm(preset=preset), LocalReducer())
    for keys in MODES:
        plan = plan_credit(tokens, algorithm(preset=preset, off_policy=keys), LocalReducer())
        assert torch.equal(plan.token_adv, base.token_adv), keys
        assert len(plan.passes) == len(base.passes)
        assert all(torch.equal(a, b) for a, b in zip(plan.passes, base.passes, strict=True))
        assert astuple(plan.stats) == astuple(base.stats)
        assert plan.off_policy.weight == plan.off_policy.tokens > 0  # every weight is 1
        assert plan.off_policy.weight_max == 1.0 and plan.off_policy.kl == 0.0


@pytest.mark.parametrize("keys", MODES, ids=MODE_IDS)
def test_weights_multiply_the_advantages_and_move_no_mask_or_denominator(gen, keys):
    """STAPO, Lopti, 20-Entropy and AR read the proximal policy, and a masked token stays in
    the denominator: only A_it changes, by exactly the weight."""
    credit = {
        "stapo": {"enabled": True},
        "lopti": {"enabled": True},
        "ar": {"alpha": 0.3},
        "entropy_mask": {"enabled": True, "rho": 0.6},
    }
    tokens = random_tokens(gen)
    base = plan_credit(tokens, algorithm(**credit), LocalReducer())
    cfg = algorithm(off_policy=keys, **credit)
    plan = plan_credit(tokens, cfg, LocalReducer())
    weight = importance_weights(
        tokens.old_logp, tokens.behaviour_logp, tokens.behaviour_known, tokens.mask, cfg.off_policy
    ).weight
    assert torch.equal(plan.token_adv, base.token_adv * weight)
    assert all(torch.equal(a, b) for a, b in zip(plan.passes, base.passes, strict=True))
    assert astuple(plan.stats)[:-2] == astuple(base.stats)[:-2]  # all but the gradient share
    if keys["mode"] == "mis":  # a masked token has no policy gradient, yet counts
        masked = (weight == 0) & (tokens.mask > 0)
        assert masked.any()
        for grad in pass_gradients(tokens, plan, cfg):
            assert torch.equal(grad[masked], torch.zeros_like(grad[masked]))
        assert base.stats.valid_tokens == plan.stats.valid_tokens


def test_rows_without_behaviour_log_probs_get_weight_one(gen):
    tokens = random_tokens(gen)
    tokens = replace(tokens, behaviour_known=torch.zeros_like(tokens.behaviour_known))
    base = plan_credit(tokens, algorithm(), LocalReducer())
    plan = plan_credit(tokens, algorithm(off_policy=MODES[0]), LocalReducer())
    assert torch.equal(plan.token_adv, base.token_adv)
    assert plan.off_policy.tokens == 0


# ----- the learner step -----------------------------------------------------------------------


def with_own_log_probs(model, seqs, cut, algo, shift=None):
    """vLLM's log-probs := the learner's own at the step's start, in the step's micro-batches
    (so in the same bits), optionally shifted by shift(group_id)."""
    cpu = torch.device("cpu")
    for mini in [m for rank in cut for m in rank]:
        for mb, stats in zip(mini, no_grad_stats(model, mini, settings(algo), cpu), strict=True):
            for seq, s in zip(mb, stats, strict=True):
                logp = s.logp if shift is None else s.logp + shift(seq.group_id)
                seq.vllm_logprobs = logp.tolist()
    return seqs


# Every preset's plan is checked above; the whole step (forwards, micro-batches, two ranks,
# Lopti's passes) on a few, as each case costs seconds.
@pytest.mark.parametrize("preset", ["grpo", "ar_lopti", "gspo"])
def test_mismatch_free_step_is_bit_identical_in_every_mode(gen, preset):
    model = tiny_model(gen)
    algo = preset_algorithm(preset)
    seqs = sample_step(model, gen, algo)
    cut = layout(seqs, gen, 2, many_micro_batches=True)
    with_own_log_probs(model, seqs, cut, algo)
    base_delta, base = run_step(model, algo, cut)
    for keys in MODES:
        delta, figures = run_step(model, preset_algorithm(preset, off_policy=keys), cut)
        assert all(torch.equal(a, b) for a, b in zip(delta, base_delta, strict=True)), keys
        assert figures.off_policy.weight == figures.off_policy.tokens > 0
        assert figures.off_policy.truncated == figures.off_policy.masked == 0


@pytest.mark.parametrize("aggregation", ["token_mean", "constant"])
def test_weights_equal_within_a_group_keep_the_cancellation(gen, aggregation):
    algo = preset_algorithm(
        "grpo", loss="linear", aggregation=aggregation, off_policy={"mode": "tis", "cap": 10.0}
    )
    model = tiny_model(gen)
    seqs = sample_step(model, gen, algo)
    cut = layout(seqs, gen, 2, many_micro_batches=True)
    shifts = (torch.rand(len(seqs), generator=gen, dtype=torch.float64) - 0.5).tolist()
    with_own_log_probs(model, seqs, cut, algo, shift=lambda g: shifts[g])
    _, figures = run_step(model, algo, cut)
    assert figures.off_policy.weight != figures.off_policy.tokens  # the weights are not all 1
    assert figures.residual_whole_group.weight > 0
    assert figures.residual_whole_group.value < 1e-12

    # Weights that differ within a group break it: the diagnostic sees that.
    noise = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (), generator=gen)))
    for seq in seqs:
        seq.vllm_logprobs = [
            v + 0.3 * torch.randn((), generator=noise).item() for v in seq.vllm_logprobs
        ]
    _, figures = run_step(model, algo, cut)
    assert figures.residual_whole_group.value > 1e-6


# ----- configuration ------------------------------------------------------------------------


def test_correction_is_on_by_default_with_stale_samples():
    assert build_config().algorithm.off_policy.mode == "none"
    stale = build_config({"trainer": {"max_staleness": 1}})
    assert stale.algorithm.off_policy.mode == "tis"
    chosen = build_config(
        {"trainer": {"max_staleness": 1}, "algorithm": {"off_policy": {"mode": "none"}}}
    )
    assert chosen.algorithm.off_policy.mode == "none"
    masked = build_config(overrides=["trainer.max_staleness=1", "algorithm.off_policy.mode=mis"])
    assert masked.algorithm.off_policy.mode == "mis"


@pytest.mark.parametrize(
    "override, message",
    [
        ("algorithm.off_policy.cap=0.9", "algorithm.off_policy.cap"),
        ("algorithm.off_policy.band=[1.2, 2.0]", "algorithm.off_policy: band"),
        ("algorithm.off_policy.band=[0.5, 0.9]", "algorithm.off_policy: band"),
        ("algorithm.off_policy.mode=is", "algorithm.off_policy.mode"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        build_config(overrides=[override])
