"""Token-credit plan: transforms, aggregation, stats.

docs/algorithms.md: 'Aggregation', 'Token-credit transforms', 'Diagnostics', and the numbered
properties of 'Properties the tests check'.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import astuple, replace

import pytest
import torch

from groupflow.config import AlgorithmConfig, ConfigError
from groupflow.learner.advantages import compute_advantages
from groupflow.learner.credit import (
    CreditPlan,
    LocalReducer,
    MiniBatchTokens,
    adv_orthogonal,
    ar_weight,
    entropy_top_mask,
    length_scale,
    lopti_split,
    micro_batch_rows,
    min_replace,
    plan_credit,
    plans_per_micro_batch,
    stapo_mask,
)
from groupflow.learner.losses import token_loss
from groupflow.run.job_config import build_config
from tests.unit.threaded_ranks import RankReducer, ThreadedRanks

F64 = torch.float64
ESTIMATORS = ["grpo", "dr_grpo", "rloo", "reinforce_baseline"]
AGGREGATIONS = ["token_mean", "seq_mean_token_sum", "constant", "seq_mean_token_mean"]
LOSSES = ["ppo", "gspo", "linear", "dfpo"]
ALL_TRANSFORMS = {
    "stapo": {"enabled": True},
    "ar": {"alpha": 0.3},
    "lopti": {"enabled": True},
    "entropy_mask": {"enabled": True},
}


def algorithm(**keys) -> AlgorithmConfig:
    return build_config({"algorithm": keys}).algorithm


def random_tokens(
    gen: torch.Generator,
    num_groups: int = 6,
    group_size: int = 4,
    width: int = 8,
    equal_groups: int = 0,
    estimator: str = "grpo",
    off_policy: bool = True,
) -> MiniBatchTokens:
    """A shuffled mini-batch of groups with unequal lengths and NaN in the padding.

    Log-probs spread over [-9, 0], so about a third of the tokens lie below STAPO's tau_p.
    The first `equal_groups` groups (in id order) have all-equal rewards. The behaviour
    (vLLM's) log-probs differ from old_logp by noise too, and one row in five has none.
    """
    rows = num_groups * group_size
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    mask = (torch.arange(width) < lengths[:, None]).to(F64)

    def noisy(x: torch.Tensor, scale: float) -> torch.Tensor:
        return (
            x + scale * torch.randn(x.shape, generator=gen, dtype=F64) if off_policy else x.clone()
        )

    old_logp = -9 * torch.rand(rows, width, generator=gen, dtype=F64)
    cur_logp = noisy(old_logp, 0.3).clamp(max=0)
    p_cur = cur_logp.exp()
    cur_sum_p2 = p_cur**2 + torch.rand(rows, width, generator=gen, dtype=F64) * (1 - p_cur) ** 2
    old_entropy = 3 * torch.rand(rows, width, generator=gen, dtype=F64)
    cur_entropy = noisy(old_entropy, 0.1).clamp(min=0)
    group_ids = torch.sort(torch.randperm(10_000, generator=gen)[:num_groups]).values
    group_ids = group_ids.repeat_interleave(group_size)
    rewards = torch.rand(rows, generator=gen, dtype=F64)
    rewards[: equal_groups * group_size] = 0.7
    advantages = compute_advantages(rewards, group_ids, estimator, token_counts=lengths)
    behaviour_logp = noisy(old_logp, 0.4)
    behaviour_known = torch.rand(rows, generator=gen) < 0.8
    order = torch.randperm(rows, generator=gen)
    per_token = [
        x[order]
        for x in (mask, old_logp, cur_logp, old_entropy, cur_entropy, cur_sum_p2, behaviour_logp)
    ]
    for x in per_token[1:]:
        x[per_token[0] == 0] = float("nan")  # padding may hold anything
    return MiniBatchTokens(
        *per_token[:-1],
        advantages=advantages[order],
        group_ids=group_ids[order],
        behaviour_logp=per_token[-1],
        behaviour_known=behaviour_known[order],
    )


def constructed_tokens(
    p: list[list[float]], entropy: list[list[float]], advantages: list[float]
) -> MiniBatchTokens:
    """Fully valid rows with the given probabilities and entropies (old = current)."""
    logp = torch.tensor(p, dtype=F64).log()
    ent = torch.tensor(entropy, dtype=F64)
    return MiniBatchTokens(
        mask=torch.ones_like(logp),
        old_logp=logp,
        cur_logp=logp.clone(),
        old_entropy=ent,
        cur_entropy=ent.clone(),
        cur_sum_p2=logp.exp() ** 2,
        advantages=torch.tensor(advantages, dtype=F64),
        group_ids=torch.zeros(len(advantages), dtype=torch.int64),
    )


def pass_losses(
    tokens: MiniBatchTokens, plan: CreditPlan, cfg: AlgorithmConfig, logp: torch.Tensor
):
    """The learner's loss of each optimizer pass over the whole mini-batch at fixed parameters."""
    out = token_loss(logp, tokens.old_logp, plan.token_adv, tokens.mask, cfg)
    return [(coef * out.loss).sum() for coef in plan.passes]


def pass_gradients(
    tokens: MiniBatchTokens, plan: CreditPlan, cfg: AlgorithmConfig
) -> list[torch.Tensor]:
    """d(pass loss)/d logp for each optimizer pass, taken at the current policy."""
    logp = tokens.cur_logp.clone().requires_grad_()
    losses = pass_losses(tokens, plan, cfg, logp)
    return [torch.autograd.grad(loss, logp, retain_graph=True)[0] for loss in losses]


def probs(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask > 0, logp, torch.full_like(logp, -math.inf)).exp()


# ----- property 1: equal rewards -> zero gradient in every mode ------------------------------


VALID_MODES = [(loss, agg) for loss in LOSSES for agg in AGGREGATIONS]
VALID_MODES.remove(("dfpo", "seq_mean_token_mean"))


@pytest.mark.parametrize("transforms", [{}, ALL_TRANSFORMS], ids=["plain", "all_transforms"])
@pytest.mark.parametrize("loss, aggregation", VALID_MODES)
def test_equal_rewards_give_zero_gradient_in_every_mode(gen, loss, aggregation, transforms):
    cfg = algorithm(loss=loss, aggregation=aggregation, **transforms)
    for estimator in ESTIMATORS:
        tokens = random_tokens(gen, equal_groups=2, estimator=estimator)
        equal_rows = tokens.group_ids <= torch.unique(tokens.group_ids)[1]
        grad = sum(pass_gradients(tokens, plan_credit(tokens, cfg, LocalReducer()), cfg))
        assert torch.equal(grad[equal_rows], torch.zeros_like(grad[equal_rows])), estimator
        assert grad[~equal_rows].abs().sum() > 0, f"{estimator}: the other groups must still learn"

        tokens = random_tokens(gen, equal_groups=6, estimator=estimator)
        grad = sum(pass_gradients(tokens, plan_credit(tokens, cfg, LocalReducer()), cfg))
        assert torch.equal(grad, torch.zeros_like(grad)), estimator


# ----- property 3: micro-batches and ranks give the gradient of one big batch ---------------


def rows_of(tokens: MiniBatchTokens, rows: torch.Tensor) -> MiniBatchTokens:
    return MiniBatchTokens(
        *(getattr(tokens, f)[rows] for f in MiniBatchTokens.__dataclass_fields__)
    )


def split_over_ranks(
    tokens: MiniBatchTokens, gen: torch.Generator, world_size: int
) -> list[torch.Tensor]:
    """Row indices per rank: whole groups on random ranks (a rank may get none), shuffled."""
    group_rank = {
        gid: torch.randint(0, world_size, (), generator=gen).item()
        for gid in tokens.group_ids.tolist()
    }
    owner = torch.tensor([group_rank[g] for g in tokens.group_ids.tolist()])
    rows = [torch.nonzero(owner == r).flatten() for r in range(world_size)]
    return [r[torch.randperm(len(r), generator=gen)] for r in rows]


def micro_batches(count: int, gen: torch.Generator) -> list[slice]:
    """Consecutive chunks of 1..5 rows: groups get cut across micro-batches."""
    cuts, start = [], 0
    while start < count:
        size = torch.randint(1, 6, (), generator=gen).item()
        cuts.append(slice(start, min(start + size, count)))
        start += size
    return cuts


def split_gradients(tokens, cfg, gen, rank_rows, plans) -> list[torch.Tensor]:
    """Per pass, the gradient summed over ranks and micro-batches, as the learner does it."""
    logp = tokens.cur_logp.clone().requires_grad_()
    grads = [torch.zeros_like(logp) for _ in plans[0].passes]
    for rows, plan in zip(rank_rows, plans, strict=True):
        for micro in micro_batches(len(rows), gen):
            sub = rows[micro]
            out = token_loss(
                logp[sub], tokens.old_logp[sub], plan.token_adv[micro], tokens.mask[sub], cfg
            )
            for k, coef in enumerate(plan.passes):
                grads[k] += torch.autograd.grad(
                    (coef[micro] * out.loss).sum(), logp, retain_graph=True
                )[0]
    return grads


SPLIT_CASES = [{"aggregation": agg} for agg in AGGREGATIONS] + [
    {"aggregation": "token_mean", **ALL_TRANSFORMS},
    {
        "aggregation": "seq_mean_token_mean",
        "stapo": {"enabled": True},
        "lopti": {"enabled": True, "eta": -0.3},
    },
    {
        "aggregation": "seq_mean_token_sum",
        "entropy_mask": {"enabled": True, "rho": 0.5},
        "stapo": {"enabled": True},
    },
    {"loss": "gspo", "aggregation": "seq_mean_token_mean"},
    {
        "loss": "dfpo",
        "aggregation": "constant",
        "dfpo": {"weight_transform": "adv_orthogonal"},
        "ar": {"alpha": 0.1},
    },
    {"off_policy": {"mode": "tis", "cap": 1.2}, "lopti": {"enabled": True}},
    {"off_policy": {"mode": "mis", "level": "sequence", "band": [0.1, 5.0]}},
]


@pytest.mark.parametrize("keys", SPLIT_CASES, ids=lambda k: "-".join(f"{a}" for a in k))
def test_ranks_and_micro_batches_give_the_one_batch_gradient(gen, keys):
    cfg = algorithm(**keys)
    tokens = random_tokens(gen, num_groups=7)
    whole = plan_credit(tokens, cfg, LocalReducer())
    expected = pass_gradients(tokens, whole, cfg)

    world_size = torch.randint(2, 5, (), generator=gen).item()
    rank_rows = split_over_ranks(tokens, gen, world_size)
    ranks = ThreadedRanks(world_size)
    plans = ranks.run(
        lambda rank: plan_credit(rows_of(tokens, rank_rows[rank]), cfg, RankReducer(ranks, rank))
    )
    assert all(len(plan.passes) == len(whole.passes) for plan in plans)
    for plan in plans:
        assert astuple(plan.stats) == pytest.approx(astuple(whole.stats), rel=1e-12)
    got = split_gradients(tokens, cfg, gen, rank_rows, plans)
    assert sum(e.abs().sum() for e in expected) > 0
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-15)


def test_a_rank_without_sequences_joins_the_plan(gen):
    # More ranks than groups: a rank holds no row of the mini-batch but makes the collectives.
    cfg = algorithm(**ALL_TRANSFORMS, aggregation="constant")
    tokens = random_tokens(gen)
    whole = plan_credit(tokens, cfg, LocalReducer())
    nothing = MiniBatchTokens(
        *(torch.zeros(0, 0, dtype=F64) for _ in range(6)),
        advantages=torch.zeros(0, dtype=F64),
        group_ids=torch.zeros(0, dtype=torch.int64),
    )
    ranks = ThreadedRanks(2)
    plans = ranks.run(
        lambda rank: plan_credit([tokens, nothing][rank], cfg, RankReducer(ranks, rank))
    )
    assert plans[0].stats == plans[1].stats == whole.stats
    assert all(torch.equal(a, b) for a, b in zip(plans[0].passes, whole.passes, strict=True))
    assert len(plans[1].passes) == len(whole.passes)
    assert all(coef.shape == (0, 0) for coef in plans[1].passes)


def test_split_gives_each_micro_batch_its_own_rows(gen):
    tokens = random_tokens(gen)
    plan = plan_credit(tokens, algorithm(lopti={"enabled": True}), LocalReducer())
    rows = len(tokens.advantages)
    cuts = sorted(torch.randint(0, rows + 1, (4,), generator=gen).tolist())
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, rows], strict=True)]  # zeros allowed
    start = 0
    for size, part in zip(sizes, plan.split(sizes), strict=True):
        assert torch.equal(part.token_adv, plan.token_adv[start : start + size])
        assert len(part.passes) == len(plan.passes) == 2
        for got, whole in zip(part.passes, plan.passes, strict=True):
            assert torch.equal(got, whole[start : start + size])
        start += size
    with pytest.raises(ValueError, match="do not add up"):
        plan.split([rows - 1])


def _rows(tokens: MiniBatchTokens, start: int, stop: int) -> MiniBatchTokens:
    return MiniBatchTokens(
        **{
            name: value[start:stop]
            for name, value in vars(tokens).items()
            if isinstance(value, torch.Tensor)
        }
    )


@pytest.mark.parametrize(
    "aggregation", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "constant"]
)
@pytest.mark.parametrize(
    "keys",
    [
        {},
        {"ar": {"alpha": 0.3}},
        {"loss": "gspo"},
        {"off_policy": {"mode": "tis", "cap": 1.5}},
        {"off_policy": {"mode": "mis", "level": "sequence", "band": [0.5, 2.0]}},
    ],
    ids=["grpo", "ar", "gspo", "tis", "mis-sequence"],
)
def test_a_micro_batch_planned_alone_gets_its_rows_of_the_whole_plan(gen, aggregation, keys):
    """Where plans_per_micro_batch holds, a micro-batch's rows from its own tokens and the
    global length scale are those of the whole mini-batch's plan, exactly, over two ranks."""
    cfg = algorithm(aggregation=aggregation, **keys)
    assert plans_per_micro_batch(cfg)
    shares = [random_tokens(gen, num_groups=3), random_tokens(gen, num_groups=4)]
    ranks = ThreadedRanks(2)

    def rank(r: int):
        tokens = shares[r]
        reducer = RankReducer(ranks, r)
        whole = plan_credit(tokens, cfg, reducer)
        lengths = (tokens.mask > 0).sum(-1).tolist()
        scale = length_scale(cfg.aggregation, lengths, reducer)
        rows = len(lengths)
        cuts = sorted(
            torch.randint(0, rows + 1, (3,), generator=torch.Generator().manual_seed(r)).tolist()
        )
        bounds = list(zip([0, *cuts], [*cuts, rows], strict=True))
        parts = whole.split([b - a for a, b in bounds])
        return [
            (micro_batch_rows(_rows(tokens, a, b), cfg, scale), part)
            for (a, b), part in zip(bounds, parts, strict=True)
        ]

    for pairs in ranks.run(rank):
        for got, want in pairs:
            torch.testing.assert_close(
                got.token_adv, want.token_adv, rtol=0, atol=0, equal_nan=True
            )
            assert len(got.passes) == len(want.passes) == 1
            torch.testing.assert_close(
                got.passes[0], want.passes[0], rtol=0, atol=0, equal_nan=True
            )


@pytest.mark.parametrize(
    "keys",
    [
        {"stapo": {"enabled": True}},
        {"entropy_mask": {"enabled": True}},
        {"lopti": {"enabled": True}},
        {"loss": "dfpo"},
    ],
    ids=["stapo", "20-entropy", "lopti", "dfpo"],
)
def test_global_credit_is_planned_over_the_whole_mini_batch(keys):
    assert not plans_per_micro_batch(algorithm(**keys))


def test_rank_local_denominators_would_change_the_gradient(gen):
    # The control for the test above: without the reducer, the split gradient differs.
    cfg = algorithm()
    tokens = random_tokens(gen, num_groups=7)
    expected = pass_gradients(tokens, plan_credit(tokens, cfg, LocalReducer()), cfg)[0]
    rank_rows = [torch.arange(0, 5), torch.arange(5, len(tokens.advantages))]
    plans = [plan_credit(rows_of(tokens, rows), cfg, LocalReducer()) for rows in rank_rows]
    got = split_gradients(tokens, cfg, gen, rank_rows, plans)[0]
    assert not torch.allclose(got, expected)


# ----- aggregation modes -----------------------------------------------------------------------


def loop_coefficient(tokens: MiniBatchTokens, aggregation: str) -> torch.Tensor:
    """c_it of docs/algorithms.md's 'Aggregation', one token at a time."""
    lengths = [int(row.sum().item()) for row in tokens.mask]
    n_seq, n_tok, l_max = sum(n > 0 for n in lengths), sum(lengths), max(lengths)
    coef = torch.zeros_like(tokens.mask)
    for i, n in enumerate(lengths):
        for t in range(n):
            coef[i, t] = {
                "token_mean": 1 / n_tok,
                "seq_mean_token_sum": 1 / n_seq,
                "constant": 1 / (n_seq * l_max),
                "seq_mean_token_mean": 1 / (n_seq * n),
            }[aggregation]
    return coef


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_aggregation_coefficients_match_loop(gen, aggregation):
    tokens = random_tokens(gen)
    plan = plan_credit(tokens, algorithm(aggregation=aggregation), LocalReducer())
    assert len(plan.passes) == 1
    torch.testing.assert_close(
        plan.passes[0], loop_coefficient(tokens, aggregation), rtol=1e-14, atol=0
    )


def test_plan_ignores_padding_content(gen):
    tokens = random_tokens(gen)
    pad = tokens.mask == 0
    clean = replace(
        tokens,
        **{
            name: getattr(tokens, name).masked_fill(pad, 0.0)
            for name in ("old_logp", "cur_logp", "old_entropy", "cur_entropy", "cur_sum_p2")
        },
    )
    cfg = algorithm(**ALL_TRANSFORMS)
    nan_plan, clean_plan = (
        plan_credit(tokens, cfg, LocalReducer()),
        plan_credit(clean, cfg, LocalReducer()),
    )
    assert torch.equal(nan_plan.token_adv, clean_plan.token_adv)
    assert all(torch.equal(a, b) for a, b in zip(nan_plan.passes, clean_plan.passes, strict=True))
    assert nan_plan.stats == clean_plan.stats


def test_plan_without_valid_tokens_has_one_zero_pass(gen):
    tokens = random_tokens(gen)
    empty = replace(tokens, mask=torch.zeros_like(tokens.mask))
    plan = plan_credit(empty, algorithm(**ALL_TRANSFORMS), LocalReducer())
    assert len(plan.passes) == 1 and not plan.passes[0].any()
    assert plan.stats.valid_tokens == 0 and plan.stats.lowprob_grad_share == 0


@pytest.mark.parametrize(
    "keys, calls",
    [
        ({}, {"gather": 1, "sum": 1}),
        ({"aggregation": "constant"}, {"gather": 1, "sum": 1, "max": 1}),
        ({"entropy_mask": {"enabled": True}, "stapo": {"enabled": True}}, {"gather": 2, "sum": 1}),
        (
            {"lopti": {"enabled": True}, "ar": {"alpha": 0.3}, "loss": "dfpo"},
            {"gather": 1, "sum": 1},
        ),
    ],
)
def test_plan_makes_few_collectives(gen, keys, calls):
    seen: Counter[str] = Counter()

    class CountingReducer(LocalReducer):
        def sum(self, t):
            seen["sum"] += 1
            return t

        def max(self, t):
            seen["max"] += 1
            return t

        def gather(self, t):
            seen["gather"] += 1
            return t

    plan_credit(random_tokens(gen), algorithm(**keys), CountingReducer())
    assert dict(seen) == calls


def test_minibatch_shapes_are_checked(gen):
    tokens = random_tokens(gen)
    with pytest.raises(ValueError, match="cur_sum_p2"):
        replace(tokens, cur_sum_p2=tokens.cur_sum_p2[:, :-1])
    with pytest.raises(ValueError, match="advantages"):
        replace(tokens, advantages=tokens.advantages[:-1])
    with pytest.raises(ValueError, match="behaviour_logp"):
        replace(tokens, behaviour_logp=tokens.behaviour_logp[:, :-1])
    with pytest.raises(ValueError, match="behaviour_known"):
        replace(tokens, behaviour_known=tokens.behaviour_known[:-1])
    with pytest.raises(ValueError, match="come together"):
        replace(tokens, behaviour_known=None)


# ----- property 4: Advantage Reweighting -------------------------------------------------------


def test_ar_alpha_zero_is_bit_identical_to_plain_advantages(gen):
    tokens = random_tokens(gen)
    valid = tokens.mask > 0
    assert torch.equal(
        ar_weight(tokens.old_logp[valid], 0.0), torch.ones_like(tokens.old_logp[valid])
    )
    plan = plan_credit(tokens, algorithm(ar={"alpha": 0.0}), LocalReducer())
    untransformed = torch.where(valid, tokens.advantages[:, None].expand_as(valid), 0.0)
    assert torch.equal(plan.token_adv, untransformed)
    cfg = algorithm()
    out = token_loss(tokens.cur_logp, tokens.old_logp, untransformed, tokens.mask, cfg).loss
    assert torch.equal(
        pass_losses(tokens, plan, cfg, tokens.cur_logp)[0], (plan.passes[0] * out).sum()
    )


def test_ar_weight_range_monotone_and_detached(gen):
    alpha = torch.rand((), generator=gen).item()
    old_logp = torch.cat(
        [-20 * torch.rand(500, generator=gen, dtype=F64), torch.zeros(1, dtype=F64)]
    )
    old_logp.requires_grad_()
    weight = ar_weight(old_logp, alpha)
    assert not weight.requires_grad
    assert (weight >= 1 - alpha).all() and (weight <= 1).all()
    by_p = weight[torch.argsort(old_logp.detach())]
    assert (by_p.diff() >= 0).all()
    assert weight[-1].item() == 1.0  # p_old = 1


def test_ar_in_plan_matches_loop_and_keeps_sign(gen):
    alpha = torch.rand((), generator=gen).item()
    tokens = random_tokens(gen)
    plan = plan_credit(tokens, algorithm(ar={"alpha": alpha}), LocalReducer())
    for i, t in torch.nonzero(tokens.mask > 0).tolist():
        a = tokens.advantages[i].item()
        expected = (alpha * math.exp(tokens.old_logp[i, t].item()) + 1 - alpha) * a
        assert plan.token_adv[i, t].item() == pytest.approx(expected, rel=1e-12, abs=1e-15)
        assert math.copysign(1, plan.token_adv[i, t].item()) == math.copysign(1, a) or a == 0


# ----- property 5: Lopti -------------------------------------------------------------------------


def test_lopti_split_is_disjoint_covering_and_strict(gen):
    tokens = random_tokens(gen)
    valid = tokens.mask > 0
    p_old = probs(tokens.old_logp, tokens.mask)
    at_eta = tuple(
        torch.nonzero(valid)[torch.randint(0, int(valid.sum()), (), generator=gen)].tolist()
    )
    eta = p_old[at_eta].item()
    low, high = lopti_split(p_old, tokens.mask, eta)
    assert not (low & high).any()
    assert torch.equal(low | high, valid)
    assert high[at_eta] and not low[at_eta]  # p = eta is high
    for i, t in torch.nonzero(valid).tolist():
        assert low[i, t].item() == (p_old[i, t].item() < eta)


def test_lopti_passes_run_low_first_and_add_up_to_the_full_loss(gen):
    tokens = random_tokens(gen)
    eta = 0.002 + 0.5 * torch.rand((), generator=gen).item()
    split = plan_credit(
        tokens, algorithm(ar={"alpha": 0.3}, lopti={"enabled": True, "eta": eta}), LocalReducer()
    )
    full = plan_credit(tokens, algorithm(ar={"alpha": 0.3}), LocalReducer())
    assert len(split.passes) == 2
    low, high = lopti_split(probs(tokens.old_logp, tokens.mask), tokens.mask, eta)
    assert torch.equal(split.passes[0] > 0, low) and torch.equal(split.passes[1] > 0, high)
    assert torch.equal(split.passes[0] + split.passes[1], full.passes[0])  # both use the full count
    assert torch.equal(split.token_adv, full.token_adv)  # AR applied before the split
    cfg = algorithm()
    logp = tokens.cur_logp
    total = sum(pass_losses(tokens, split, cfg, logp))
    # Two partial sums against one: equal up to float64 reassociation of terms that cancel.
    torch.testing.assert_close(total, pass_losses(tokens, full, cfg, logp)[0], rtol=1e-11, atol=0)


def test_lopti_negative_eta_reverses_the_order(gen):
    tokens = random_tokens(gen)
    forward = plan_credit(tokens, algorithm(lopti={"enabled": True, "eta": 0.01}), LocalReducer())
    reverse = plan_credit(tokens, algorithm(lopti={"enabled": True, "eta": -0.01}), LocalReducer())
    assert len(forward.passes) == len(reverse.passes) == 2
    assert torch.equal(forward.passes[0], reverse.passes[1]) and torch.equal(
        forward.passes[1], reverse.passes[0]
    )


def test_lopti_drops_an_empty_pass(gen):
    tokens = random_tokens(gen)  # p_old >= exp(-9) > 1e-6: no low tokens
    plan = plan_credit(tokens, algorithm(lopti={"enabled": True, "eta": 1e-6}), LocalReducer())
    assert len(plan.passes) == 1
    assert torch.equal(plan.passes[0], plan_credit(tokens, algorithm(), LocalReducer()).passes[0])


def test_lopti_split_depends_on_old_policy_only(gen):
    # Pass 2 runs after pass 1 has moved the policy: its split and A must come from old_logp.
    tokens = random_tokens(gen)
    cfg = algorithm(ar={"alpha": 0.3}, lopti={"enabled": True}, stapo={"prob_source": "old"})
    moved = replace(
        tokens, cur_logp=(tokens.cur_logp + 1.0).clamp(max=0), cur_entropy=tokens.cur_entropy * 2
    )
    before, after = (
        plan_credit(tokens, cfg, LocalReducer()),
        plan_credit(moved, cfg, LocalReducer()),
    )
    assert torch.equal(before.token_adv, after.token_adv)
    assert all(torch.equal(a, b) for a, b in zip(before.passes, after.passes, strict=True))


# ----- property 6: STAPO ---------------------------------------------------------------------------


def loop_stapo(tokens: MiniBatchTokens, tau_p: float, q: float) -> set[tuple[int, int]]:
    """STAPO (docs/algorithms.md) token by token: candidates, entropy quantile, silenced set."""
    p = tokens.cur_logp.exp()
    candidates = [
        (i, t)
        for i, t in torch.nonzero(tokens.mask > 0).tolist()
        if tokens.advantages[i] > 0 and p[i, t].item() < tau_p
    ]
    if not candidates:
        return set()
    tau_h = torch.quantile(
        torch.tensor([tokens.cur_entropy[c].item() for c in candidates], dtype=F64), q
    ).item()
    return {c for c in candidates if tokens.cur_entropy[c].item() < tau_h}


def test_stapo_silences_exactly_the_tokens_meeting_all_three_conditions(gen):
    tokens = random_tokens(gen)
    q = torch.rand((), generator=gen).item()
    plan = plan_credit(tokens, algorithm(stapo={"enabled": True, "quantile": q}), LocalReducer())
    expected = loop_stapo(tokens, 0.002, q)
    silenced = stapo_mask(
        tokens.cur_logp.exp(), tokens.cur_entropy, tokens.advantages, tokens.mask, 0.002, q
    )
    assert {tuple(c) for c in torch.nonzero(silenced).tolist()} == expected
    valid = int(tokens.mask.sum().item())
    assert plan.stats.stapo_silenced_frac == pytest.approx(len(expected) / valid)
    zero_coef = {
        tuple(c) for c in torch.nonzero((plan.passes[0] == 0) & (tokens.mask > 0)).tolist()
    }
    assert zero_coef == expected


def test_stapo_never_silences_a_token_missing_a_condition():
    # Each token misses exactly one condition: A <= 0, p >= tau_p, or H >= tau_h (the
    # candidates share one entropy, so none lies below their quantile).
    tokens = constructed_tokens(
        p=[[1e-4, 0.5, 1e-4], [1e-4, 1e-4, 0.3], [0.9, 1e-3, 1e-4]],
        entropy=[[0.01, 0.01, 0.01], [0.01, 0.01, 0.01], [0.01, 2.0, 2.0]],
        advantages=[-1.0, 0.0, 1.0],
    )
    cfg = algorithm(stapo={"enabled": True})
    plan = plan_credit(tokens, cfg, LocalReducer())
    assert plan.stats.spurious_frac == 0 and plan.stats.stapo_silenced_frac == 0
    off = plan_credit(tokens, algorithm(), LocalReducer())
    assert torch.equal(plan.passes[0], off.passes[0])


def test_stapo_silences_on_a_batch_with_spurious_tokens():
    tokens = constructed_tokens(
        p=[[1e-4, 1e-4, 1e-4, 1e-4, 0.5], [1e-4, 0.5, 0.5, 0.5, 0.5]],
        entropy=[[0.1, 0.2, 0.3, 0.4, 0.05], [0.05, 1.0, 1.0, 1.0, 1.0]],
        advantages=[1.0, -1.0],
    )
    plan = plan_credit(tokens, algorithm(stapo={"enabled": True, "quantile": 0.75}), LocalReducer())
    # Candidates: row 0's four p = 1e-4 tokens; tau_h = quantile_0.75(0.1..0.4) = 0.325.
    assert plan.stats.stapo_silenced_frac == pytest.approx(3 / 10)
    assert plan.stats.spurious_frac == pytest.approx(3 / 10)
    assert torch.equal(plan.passes[0][0, :4] == 0, torch.tensor([True, True, True, False]))


def test_stapo_with_no_candidates_is_exactly_the_unmasked_plan(gen):
    tokens = random_tokens(gen)
    cfg = algorithm(stapo={"enabled": True, "tau_p": 1e-6})  # p >= exp(-9.3) > 1e-6 everywhere
    plan, off = (
        plan_credit(tokens, cfg, LocalReducer()),
        plan_credit(tokens, algorithm(), LocalReducer()),
    )
    assert torch.equal(plan.token_adv, off.token_adv) and torch.equal(plan.passes[0], off.passes[0])
    assert plan.stats.stapo_silenced_frac == 0


def test_stapo_quantile_is_over_candidates_only(gen):
    tokens = random_tokens(gen)
    candidates = (
        (tokens.mask > 0) & (tokens.advantages[:, None] > 0) & (tokens.cur_logp.exp() < 0.002)
    )
    # Candidates get entropies in [0, 1), everything else in [5, 6): a quantile taken over all
    # tokens would sit above every candidate and silence all of them.
    entropy = torch.where(candidates, torch.rand(tokens.mask.shape, generator=gen, dtype=F64), 5.5)
    tokens = replace(tokens, cur_entropy=entropy)
    plan = plan_credit(tokens, algorithm(stapo={"enabled": True}), LocalReducer())
    expected = loop_stapo(tokens, 0.002, 0.75)
    assert 0 < len(expected) < candidates.sum().item()
    assert plan.stats.stapo_silenced_frac == pytest.approx(len(expected) / tokens.mask.sum().item())


@pytest.mark.parametrize("mask_fn", ["stapo", "entropy_top"])
def test_masks_ignore_last_bit_noise_on_entropies_tied_at_the_quantile(gen, mask_fn):
    """Copies of one entropy (a prefix shared within a group) that differ only in the last bits,
    as another batch layout rounds them, are masked alike: the layout never picks a copy."""
    n = 12
    base = torch.rand(n, generator=gen, dtype=F64).sort().values
    base[7:11] = base[7]  # four copies of one value, 7th to 10th in order; the 0.75 quantile
    quantile = 0.75  # of 12 values lies at 8.25, between two of the copies
    copies = slice(7, 11)
    ulp = torch.finfo(F64).eps * base[7]
    noisy = base.clone()
    noisy[copies] += torch.tensor([-2.0, -1.0, 1.0, 2.0], dtype=F64) * ulp
    perm = torch.randperm(n, generator=gen)
    base, noisy = base[perm], noisy[perm]
    copies = (perm >= 7) & (perm < 11)
    mask = torch.ones(1, n, dtype=F64)
    if mask_fn == "stapo":
        p, advantages = torch.zeros(1, n, dtype=F64), torch.ones(1, dtype=F64)
        exact = stapo_mask(p, base[None], advantages, mask, 0.002, quantile)
        rounded = stapo_mask(p, noisy[None], advantages, mask, 0.002, quantile)
    else:
        exact = entropy_top_mask(base[None], mask, rho=0.25)
        rounded = entropy_top_mask(noisy[None], mask, rho=0.25)
    assert torch.equal(exact, rounded)
    assert exact[0, copies].all() or not exact[0, copies].any()


def test_stapo_loss_is_mean_over_unsilenced_tokens(gen):
    tokens = random_tokens(gen)
    cfg = algorithm(stapo={"enabled": True})
    plan = plan_credit(tokens, cfg, LocalReducer())
    silenced = stapo_mask(
        tokens.cur_logp.exp(), tokens.cur_entropy, tokens.advantages, tokens.mask, 0.002, 0.75
    )
    assert silenced.any()
    keep = ((tokens.mask > 0) & ~silenced).to(F64)
    loss = token_loss(tokens.cur_logp, tokens.old_logp, plan.token_adv, tokens.mask, cfg).loss
    torch.testing.assert_close(
        pass_losses(tokens, plan, cfg, tokens.cur_logp)[0], (keep * loss).sum() / keep.sum()
    )


def test_stapo_prob_source(gen):
    # A token that is spurious under the old policy but not under the current one.
    tokens = constructed_tokens(p=[[1e-4, 1e-4, 0.5]], entropy=[[0.1, 0.5, 0.1]], advantages=[1.0])
    tokens = replace(tokens, cur_logp=torch.tensor([[0.5, 1e-4, 0.5]], dtype=F64).log())
    on_old = plan_credit(
        tokens, algorithm(stapo={"enabled": True, "prob_source": "old"}), LocalReducer()
    )
    on_cur = plan_credit(
        tokens, algorithm(stapo={"enabled": True, "prob_source": "current"}), LocalReducer()
    )
    assert on_old.stats.stapo_silenced_frac == pytest.approx(1 / 3)  # tau_h = 0.4 over {0.1, 0.5}
    assert on_cur.stats.stapo_silenced_frac == 0  # the only candidate is at its own quantile


def test_spurious_frac_is_reported_with_stapo_off(gen):
    tokens = random_tokens(gen)
    on = plan_credit(tokens, algorithm(stapo={"enabled": True}), LocalReducer())
    off = plan_credit(tokens, algorithm(), LocalReducer())
    assert off.stats.spurious_frac == on.stats.spurious_frac == on.stats.stapo_silenced_frac > 0
    assert off.stats.stapo_silenced_frac == 0 and off.stats.trained_frac == 1


# ----- 20-Entropy -------------------------------------------------------------------------------


def test_entropy20_keeps_the_top_quantile_over_the_full_count(gen):
    tokens = random_tokens(gen)
    rho = 0.1 + 0.8 * torch.rand((), generator=gen).item()
    plan = plan_credit(
        tokens, algorithm(entropy_mask={"enabled": True, "rho": rho}), LocalReducer()
    )
    valid = tokens.mask > 0
    tau = torch.quantile(tokens.cur_entropy[valid], 1 - rho)
    kept = valid & (tokens.cur_entropy >= tau)
    assert torch.equal(entropy_top_mask(tokens.cur_entropy, tokens.mask, rho), kept)
    n_valid = valid.sum().item()
    torch.testing.assert_close(plan.passes[0], kept.to(F64) / n_valid, rtol=1e-15, atol=0)
    assert plan.stats.trained_frac == pytest.approx(rho, abs=1.5 / n_valid)


# ----- property 8: dfpo weights ----------------------------------------------------------------


@pytest.mark.parametrize("transform", [min_replace, adv_orthogonal])
def test_dfpo_weight_transforms_are_orthogonal_to_a_and_detached(gen, transform):
    tokens = random_tokens(gen, num_groups=8, equal_groups=1)
    w = (1 + 0.3 * torch.randn(tokens.advantages.shape, generator=gen, dtype=F64)).requires_grad_()
    w_tilde = transform(w, tokens.advantages, tokens.group_ids)
    assert not w_tilde.requires_grad
    for gid in tokens.group_ids.unique():
        idx = tokens.group_ids == gid
        a, wg, wt = tokens.advantages[idx], w.detach()[idx], w_tilde[idx]
        assert abs(torch.dot(a, wt).item()) <= 1e-12 * (a.abs().sum() * wt.abs().max()).item()
        if transform is min_replace:
            assert torch.equal(wt, torch.full_like(wt, wg.min().item()))
        elif a.abs().sum() > 0:
            expected = wg - (torch.dot(a, wg) / torch.dot(a, a)) * a
            torch.testing.assert_close(wt, expected, rtol=1e-13, atol=1e-15)
        else:
            assert torch.equal(wt, wg)


@pytest.mark.parametrize("transform", ["min_replace", "adv_orthogonal"])
def test_dfpo_plan_folds_the_group_weight_into_a(gen, transform):
    tokens = random_tokens(gen)
    plan = plan_credit(
        tokens, algorithm(loss="dfpo", dfpo={"weight_transform": transform}), LocalReducer()
    )
    valid = tokens.mask > 0
    w = torch.tensor(
        [
            math.exp(((tokens.cur_logp[i] - tokens.old_logp[i])[valid[i]]).mean().item())
            for i in range(len(valid))
        ],
        dtype=F64,
    )
    w_tilde = {"min_replace": min_replace, "adv_orthogonal": adv_orthogonal}[transform](
        w, tokens.advantages, tokens.group_ids
    )
    expected = torch.where(valid, (tokens.advantages * w_tilde)[:, None].expand_as(valid), 0.0)
    torch.testing.assert_close(plan.token_adv, expected, rtol=1e-12, atol=1e-15)
    assert not plan.token_adv.requires_grad


def test_dfpo_with_seq_mean_token_mean_is_refused():
    with pytest.raises(ConfigError):
        build_config({"algorithm": {"loss": "dfpo", "aggregation": "seq_mean_token_mean"}})


# ----- low-probability diagnostics ------------------------------------------------------------


def test_lowprob_stats_match_loop(gen):
    tokens = random_tokens(gen)
    eta = 0.001 + 0.5 * torch.rand((), generator=gen).item()
    plan = plan_credit(tokens, algorithm(lowprob_eta=eta), LocalReducer())
    low = total = low_norm = total_norm = 0.0
    for i, t in torch.nonzero(tokens.mask > 0).tolist():
        p = math.exp(tokens.cur_logp[i, t].item())
        norm = abs(tokens.advantages[i].item()) * math.sqrt(
            1 - 2 * p + tokens.cur_sum_p2[i, t].item()
        )
        total += 1
        total_norm += norm
        if p < eta:
            low += 1
            low_norm += norm
    assert plan.stats.lowprob_frac == pytest.approx(low / total)
    assert plan.stats.lowprob_grad_share == pytest.approx(low_norm / total_norm, rel=1e-10)
