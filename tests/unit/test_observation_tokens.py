"""Observation tokens (TrainSequence.loss_mask; docs/algorithms.md, 'Observation tokens'):
the tokens a tool or an environment inserted between a trajectory's turns are context for the
forward and nothing else. For every preset, in float64: a plan over rows with observations is
the plan over the same rows with them taken out, whatever the observations hold; the loss has
no gradient at an observation's statistics; and a whole step with observations is unchanged
by micro-batches and ranks."""

from __future__ import annotations

from dataclasses import astuple, replace

import pytest
import torch

from groupflow.config.presets import PRESETS
from groupflow.core.records import TrainSequence
from groupflow.learner.auto_threshold import RunningProbabilityThreshold
from groupflow.learner.credit import LocalReducer, MiniBatchTokens, plan_credit
from groupflow.learner.micro_batch import MicroBatchForward, micro_batch_loss
from groupflow.learner.token_stats import TokenStats
from tests.unit.test_credit import algorithm, random_tokens
from tests.unit.test_learner_step import algorithm as preset_algorithm
from tests.unit.test_learner_step import (
    layout,
    one_thread,  # noqa: F401 (autouse fixture)
    run_step,
    sample_step,
    tiny_model,
)

F64 = torch.float64
PER_TOKEN = ("mask", "old_logp", "cur_logp", "old_entropy", "cur_entropy", "cur_sum_p2")


def with_observations(tokens: MiniBatchTokens, gen: torch.Generator) -> tuple:
    """`tokens` with observation columns put between its tokens, each holding random values
    (or NaN) and a zero in the mask; and where the original columns went."""
    rows, width = tokens.mask.shape
    inserted = torch.rand(rows, 2 * width, generator=gen) < 0.4
    keep = ~inserted
    # every row has room for its `width` columns: the first `width` places not inserted
    place = torch.zeros(rows, width, dtype=torch.long)
    for r in range(rows):
        cols = torch.nonzero(keep[r]).flatten()
        if len(cols) < width:  # too many inserted: the row's tail takes the rest
            extra = torch.arange(2 * width, 3 * width)[: width - len(cols)]
            cols = torch.cat([cols, extra])
        place[r] = cols[:width]

    def spread(values: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
        out = fill.clone()
        out.scatter_(1, place, values)
        return out

    total = 3 * width
    junk = {
        name: torch.where(
            torch.rand(rows, total, generator=gen) < 0.2,
            torch.full((rows, total), float("nan"), dtype=F64),
            -5 * torch.rand(rows, total, generator=gen, dtype=F64),
        ).abs()
        * (-1 if "logp" in name else 1)
        for name in PER_TOKEN[1:] + ("behaviour_logp",)
    }
    holed = {name: spread(getattr(tokens, name), junk[name]) for name in PER_TOKEN[1:]} | {
        "mask": spread(tokens.mask, torch.zeros(rows, total, dtype=F64))
    }
    holed["behaviour_logp"] = spread(tokens.behaviour_logp, junk["behaviour_logp"])
    return replace(tokens, **holed), place


CASES = [pytest.param(p, {}, id=p) for p in sorted(PRESETS)] + [
    pytest.param("grpo", {"cancellation_diagnostic": True, "ar": {"alpha": 0.3}}, id="grpo-ar"),
    pytest.param("stapo", {"stapo": {"tau_p": "auto"}}, id="stapo-auto"),
]


@pytest.mark.parametrize("preset, keys", CASES)
def test_a_plan_over_observations_is_the_plan_without_them(gen, preset, keys):
    cfg = algorithm(preset=preset, **keys)
    tokens = random_tokens(gen)
    holed, place = with_observations(tokens, gen)
    want, got = (
        plan_credit(t, cfg, LocalReducer(), RunningProbabilityThreshold(0.05, 0.8))
        for t in (tokens, holed)
    )
    valid = tokens.mask > 0
    assert len(got.passes) == len(want.passes)
    for got_rows, want_rows in zip(
        [got.token_adv, *got.passes], [want.token_adv, *want.passes], strict=True
    ):
        at_tokens = got_rows.gather(1, place)
        torch.testing.assert_close(at_tokens[valid], want_rows[valid], rtol=1e-13, atol=0)
    for coef in got.passes:  # an observation (or padding) is trained by no pass
        assert not coef[holed.mask == 0].any()
    assert astuple(got.stats) == pytest.approx(astuple(want.stats), rel=1e-12)


@pytest.mark.parametrize("preset, keys", CASES)
def test_the_loss_has_no_gradient_at_an_observation(gen, preset, keys):
    cfg = algorithm(preset=preset, **keys, kl={"coef": 0.1}, entropy_coef=0.01)
    tokens = random_tokens(gen, off_policy=False)
    holed, _ = with_observations(tokens, gen)
    plan = plan_credit(holed, cfg, LocalReducer(), RunningProbabilityThreshold(0.05, 0.8))
    rows, width = holed.mask.shape
    logp = torch.nan_to_num(holed.cur_logp, nan=-1.0).requires_grad_()
    entropy = torch.nan_to_num(holed.cur_entropy, nan=1.0).requires_grad_()
    stats = [TokenStats(logp[r], entropy[r], holed.cur_sum_p2[r]) for r in range(rows)]
    old = [
        TokenStats(torch.nan_to_num(holed.old_logp[r], nan=-1.0), None, None) for r in range(rows)
    ]
    forward = MicroBatchForward(stats, masks=list(holed.mask))
    ref = [torch.zeros(width, dtype=F64) - 2.0 for _ in range(rows)]
    for k in range(len(plan.passes)):
        loss = micro_batch_loss(forward, old, ref, plan, k, cfg, token_grads=False).loss
        d_logp, d_entropy = torch.autograd.grad(loss, [logp, entropy])
        observations = holed.mask == 0
        assert not d_logp[observations].any() and not d_entropy[observations].any()
        assert d_logp[~observations].any(), "the model tokens must carry a gradient"


@pytest.mark.parametrize("preset", ["grpo", "stapo", "lopti", "dfpo", "gspo"])
def test_a_step_with_observations_is_unchanged_by_micro_batches_and_ranks(gen, preset):
    algo = preset_algorithm(preset)
    model = tiny_model(gen)
    seqs = []
    for s in sample_step(model, gen, algo):
        mask = (torch.rand(s.num_response_tokens, generator=gen) < 0.7).long()
        mask[0] = 1  # the first response token is the model's
        logprobs = [lp for lp, m in zip(s.vllm_logprobs, mask.tolist(), strict=False) if m]
        seqs.append(
            replace(s, loss_mask=mask.tolist(), vllm_logprobs=logprobs if s.vllm_logprobs else [])
        )
    base, _ = run_step(model, algo, layout(seqs, gen, 1, many_micro_batches=False))
    scale = max(d.abs().max().item() for d in base)
    assert scale > 0
    for world_size, many in [(1, True), (2, True)]:
        delta, _ = run_step(model, algo, layout(seqs, gen, world_size, many_micro_batches=many))
        for got, want in zip(delta, base, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7 * scale)


@pytest.mark.parametrize(
    "changes, said",
    [
        ({"loss_mask": [1, 0]}, "a loss mask of 2 for 3 response tokens"),
        ({"loss_mask": [1, 2, 0]}, "0 and 1 only"),
        ({"loss_mask": [1, 0, 1], "vllm_logprobs": [-0.1, -0.2, -0.3]}, "3 vLLM log-probs for 2"),
    ],
)
def test_a_bad_loss_mask_names_its_sequence(changes, said):
    fields = dict(
        input_ids=[5, 6, 7, 8, 9],
        prompt_len=2,
        advantage=1.0,
        group_id=4,
        policy_version=0,
        vllm_logprobs=[],
    )
    with pytest.raises(ValueError, match="sequence of group 4") as err:
        TrainSequence(**(fields | changes))
    assert said in str(err.value)
    ok = TrainSequence(**(fields | {"loss_mask": [1, 0, 1], "vllm_logprobs": [-0.1, -0.2]}))
    assert ok.num_model_tokens == 2
