"""Advantage estimators, on fresh random inputs.

docs/algorithms.md, 'Advantage estimators' and property 9 of 'Properties the tests check'.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from groupflow.learner.advantages import ADVANTAGE_ESTIMATORS, compute_advantages

ESTIMATORS = sorted(ADVANTAGE_ESTIMATORS)


def random_groups(
    gen: torch.Generator, num_groups: int = 7
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rewards, group_ids, token_counts) for shuffled groups of sizes 1..6 and arbitrary ids.

    Some groups get binary rewards, some continuous, one is all-equal on a value that does not
    survive rounding in a mean (0.1), one has size 1.
    """
    sizes = torch.randint(2, 7, (num_groups,), generator=gen).tolist()
    sizes[0] = 1
    ids = (torch.randperm(1000, generator=gen)[:num_groups] * 13 - 500).tolist()
    rewards, group_ids = [], []
    for g, (size, gid) in enumerate(zip(sizes, ids, strict=True)):
        if g == 1:
            values = [0.1] * size
        elif g % 2:
            values = torch.randint(0, 2, (size,), generator=gen).double().tolist()
        else:
            values = torch.rand(size, generator=gen, dtype=torch.float64).tolist()
        rewards += values
        group_ids += [gid] * size
    order = torch.randperm(len(rewards), generator=gen)
    rewards_t = torch.tensor(rewards, dtype=torch.float64)[order]
    group_ids_t = torch.tensor(group_ids, dtype=torch.int64)[order]
    token_counts = torch.randint(1, 50, (len(rewards),), generator=gen)
    return rewards_t, group_ids_t, token_counts


def members(group_ids: torch.Tensor) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, gid in enumerate(group_ids.tolist()):
        out.setdefault(gid, []).append(i)
    return out


def loop_advantages(rewards, group_ids, estimator, std, token_counts) -> list[float]:
    """docs/algorithms.md's 'Advantage estimators', one response at a time, in plain Python."""
    r = rewards.tolist()
    adv = [0.0] * len(r)
    for idx in members(group_ids).values():
        values = [r[i] for i in idx]
        if len(set(values)) == 1:
            continue  # all equal (or a single response): A = 0
        mean = statistics.fmean(values)
        for i in idx:
            if estimator == "grpo":
                spread = {"unbiased": statistics.stdev, "biased": statistics.pstdev}.get(std)
                adv[i] = (r[i] - mean) / (spread(values) + 1e-6) if spread else r[i] - mean
            elif estimator == "rloo":
                others = [r[j] for j in idx if j != i]
                adv[i] = r[i] - sum(others) / len(others)
            else:
                adv[i] = r[i] - mean
    if estimator == "reinforce_baseline":
        per_token = [a for a, n in zip(adv, token_counts.tolist(), strict=True) for _ in range(n)]
        mean, spread = statistics.fmean(per_token), statistics.pstdev(per_token)
        constant = {
            i for idx in members(group_ids).values() if len({r[j] for j in idx}) == 1 for i in idx
        }
        adv = [0.0 if i in constant else (a - mean) / (spread + 1e-6) for i, a in enumerate(adv)]
    return adv


@pytest.mark.parametrize(
    "estimator, std",
    [
        ("grpo", "unbiased"),
        ("grpo", "biased"),
        ("grpo", "none"),
        ("dr_grpo", "unbiased"),
        ("rloo", "unbiased"),
    ]
    + [("reinforce_baseline", "unbiased")],
)
def test_estimator_matches_loop_formula(gen, estimator, std):
    rewards, group_ids, token_counts = random_groups(gen)
    got = compute_advantages(rewards, group_ids, estimator, std=std, token_counts=token_counts)
    expected = torch.tensor(
        loop_advantages(rewards, group_ids, estimator, std, token_counts), dtype=torch.float64
    )
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_equal_rewards_give_exactly_zero(gen, estimator):
    rewards, group_ids, token_counts = random_groups(gen)
    got = compute_advantages(rewards, group_ids, estimator, token_counts=token_counts)
    for idx in members(group_ids).values():
        if len({rewards[i].item() for i in idx}) == 1:
            assert all(got[i].item() == 0.0 for i in idx), (estimator, idx, got[idx])
        else:
            assert any(got[i].item() != 0.0 for i in idx), (estimator, idx, got[idx])


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_group_of_size_one_gets_zero(gen, estimator):
    rewards = torch.rand(5, generator=gen, dtype=torch.float64)
    got = compute_advantages(
        rewards, torch.arange(5) * 3, estimator, token_counts=torch.full((5,), 4)
    )
    assert torch.equal(got, torch.zeros(5, dtype=torch.float64))


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_group_advantages_sum_to_zero(gen, estimator):
    # The premise of token gradient cancellation (docs/algorithms.md, 'Aggregation'):
    # sum_i A_i = 0 in every group.
    rewards, group_ids, _ = random_groups(gen)
    got = compute_advantages(rewards, group_ids, estimator)
    for idx in members(group_ids).values():
        assert abs(got[idx].sum().item()) <= 1e-12 * max(1.0, got[idx].abs().sum().item())


def test_reinforce_baseline_is_whitened_over_tokens(gen):
    rewards = torch.rand(12, generator=gen, dtype=torch.float64)
    group_ids = torch.arange(12) // 4
    counts = torch.randint(1, 30, (12,), generator=gen)
    got = compute_advantages(rewards, group_ids, "reinforce_baseline", token_counts=counts)
    per_token = got.repeat_interleave(counts)
    assert abs(per_token.mean().item()) < 1e-12
    assert per_token.std(correction=0).item() == pytest.approx(1.0, abs=1e-5)
    # Weighting by tokens matters: one response per token-count gives another answer.
    unweighted = compute_advantages(
        rewards, group_ids, "reinforce_baseline", token_counts=torch.ones(12)
    )
    assert not torch.allclose(got, unweighted)


def test_reinforce_baseline_requires_token_counts():
    with pytest.raises(ValueError, match="token_counts"):
        compute_advantages(torch.tensor([0.0, 1.0]), torch.tensor([0, 0]), "reinforce_baseline")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_dtype_is_kept(gen, dtype, estimator):
    rewards, group_ids, counts = random_groups(gen)
    got = compute_advantages(rewards.to(dtype), group_ids, estimator, token_counts=counts)
    assert got.dtype == dtype
    assert torch.isfinite(got).all()


def test_rejects_unknown_estimator_and_integer_rewards():
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        compute_advantages(torch.tensor([0.0, 1.0]), torch.tensor([0, 0]), "ppo")
    with pytest.raises(ValueError, match="floating-point"):
        compute_advantages(torch.tensor([0, 1]), torch.tensor([0, 0]), "grpo")


def test_empty_batch():
    got = compute_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.int64), "grpo")
    assert got.shape == (0,)


@pytest.mark.parametrize("name", ESTIMATORS)
def test_registry_entries_cite_their_paper(name):
    doc = ADVANTAGE_ESTIMATORS[name].__doc__ or ""
    assert "arXiv" in doc, f"{name}: docstring must cite its paper"


def test_grpo_on_a_hand_computed_group():
    got = compute_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([5, 5, 5, 5]), "grpo")
    std = math.sqrt((0.75**2 + 3 * 0.25**2) / 3)
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25]) / (std + 1e-6)
    torch.testing.assert_close(got, expected)
