"""STAPO's `tau_p: auto`: the running probability histogram and the threshold it sets."""

from __future__ import annotations

import pytest
import torch

from groupflow.config import ConfigError
from groupflow.learner.auto_threshold import (
    BINS_PER_DECADE,
    NUM_BINS,
    RunningProbabilityThreshold,
    probability_histogram,
)
from groupflow.learner.credit import LocalReducer, plan_credit
from groupflow.run.job_config import build_config
from tests.unit.test_credit import loop_stapo, random_tokens, rows_of, split_over_ranks
from tests.unit.threaded_ranks import RankReducer, ThreadedRanks

F64 = torch.float64
ONE_BIN = 10 ** (1 / BINS_PER_DECADE)


def random_probabilities(gen: torch.Generator, n: int) -> torch.Tensor:
    """Mostly confident tokens with a long low-probability tail, as a peaked policy samples."""
    log10 = torch.where(
        torch.rand(n, generator=gen, dtype=F64) < 0.9,
        -0.3 * torch.rand(n, generator=gen, dtype=F64),
        -8 * torch.rand(n, generator=gen, dtype=F64),
    )
    return 10**log10


@pytest.mark.parametrize("seed", range(5))
def test_the_threshold_puts_less_than_the_target_share_below_it_within_one_bin(seed):
    gen = torch.Generator().manual_seed(seed)
    p = random_probabilities(gen, int(torch.randint(500, 20_000, (), generator=gen)))
    target = float(torch.empty((), dtype=F64).uniform_(0.002, 0.5, generator=gen))
    tau = RunningProbabilityThreshold(target, decay=0.0).update(probability_histogram(p))
    share = lambda t: float((p < t).to(F64).mean())  # noqa: E731
    assert share(tau) < target  # never above the exact quantile
    assert share(tau * ONE_BIN * (1 + 1e-9)) >= target  # and at most one bin below it


def test_the_histogram_counts_every_probability_once_extremes_included():
    gen = torch.Generator().manual_seed(1)
    p = torch.cat([random_probabilities(gen, 1000), torch.tensor([0.0, 1e-300, 1.0], dtype=F64)])
    counts = probability_histogram(p.reshape(-1, 1))
    assert counts.shape == (NUM_BINS,) and counts.sum() == len(p)
    assert counts[0] == 2 and counts[-1] >= 1  # p = 0 and 1e-300 in the lowest bin, 1.0 the top


def test_the_running_distribution_follows_the_policy_with_its_decay():
    """After a sharpening, the threshold moves from the old tail to the new one at the pace
    the decay sets: with decay 0 at once, with decay 0.8 over a few mini-batches."""
    gen = torch.Generator().manual_seed(2)
    flat = 10 ** (-2 * torch.rand(5000, generator=gen, dtype=F64))
    sharp = 10 ** (-6 * torch.rand(5000, generator=gen, dtype=F64))
    quick = RunningProbabilityThreshold(0.05, decay=0.0)
    slow = RunningProbabilityThreshold(0.05, decay=0.8)
    for threshold in (quick, slow):
        threshold.update(probability_histogram(flat))
    before = slow.threshold()
    after_quick = quick.update(probability_histogram(sharp))
    path = [slow.update(probability_histogram(sharp)) for _ in range(30)]
    assert after_quick < before / 10  # the new, lower tail at once
    assert path[0] > after_quick  # the old distribution still weighs
    assert all(a >= b for a, b in zip(path, path[1:], strict=False))
    assert path[-1] == pytest.approx(after_quick, rel=ONE_BIN - 1)


def test_no_tokens_seen_means_no_threshold():
    assert RunningProbabilityThreshold(0.01, 0.5).update(torch.zeros(NUM_BINS, dtype=F64)) == 0


def test_auto_in_the_plan_is_fixed_tau_p_at_the_threshold_it_reports(gen):
    """A plan with tau_p: auto silences exactly what a fixed tau_p at the reported threshold
    silences, and the share of examined tokens below it reaches the target."""
    tokens = random_tokens(gen)
    target = 0.3
    cfg = build_config(
        {"algorithm": {"stapo": {"enabled": True, "tau_p": "auto", "target_share": target}}}
    ).algorithm
    auto = RunningProbabilityThreshold(target, decay=0.0)
    plan = plan_credit(tokens, cfg, LocalReducer(), auto)
    tau = plan.stats.stapo_tau_p
    examined = (tokens.mask > 0) & (tokens.advantages[:, None] > 0)
    p = tokens.cur_logp.exp()[examined]
    assert float((p < tau).to(F64).mean()) < target <= float((p < tau * ONE_BIN).to(F64).mean())
    expected = loop_stapo(tokens, tau, 0.75)
    assert expected
    silenced = (plan.passes[0] == 0) & (tokens.mask > 0)
    assert {tuple(c) for c in torch.nonzero(silenced).tolist()} == expected


def test_auto_over_ranks_is_the_single_process_threshold(gen):
    tokens = random_tokens(gen)
    cfg = build_config(
        {"algorithm": {"stapo": {"enabled": True, "tau_p": "auto", "target_share": 0.2}}}
    ).algorithm
    whole = plan_credit(tokens, cfg, LocalReducer(), RunningProbabilityThreshold(0.2, 0.8))
    world_size = 3
    rank_rows = split_over_ranks(tokens, gen, world_size)
    ranks = ThreadedRanks(world_size)
    plans = ranks.run(
        lambda rank: plan_credit(
            rows_of(tokens, rank_rows[rank]),
            cfg,
            RankReducer(ranks, rank),
            RunningProbabilityThreshold(0.2, 0.8),
        )
    )
    assert {plan.stats.stapo_tau_p for plan in plans} == {whole.stats.stapo_tau_p}
    assert all(
        plan.stats.spurious_frac == pytest.approx(whole.stats.spurious_frac) for plan in plans
    )


def test_auto_without_a_running_threshold_is_refused(gen):
    cfg = build_config({"algorithm": {"stapo": {"tau_p": "auto"}}}).algorithm
    with pytest.raises(ValueError, match="tau_p"):
        plan_credit(random_tokens(gen), cfg, LocalReducer())


@pytest.mark.parametrize(
    ("key", "value"),
    [("tau_p", "autox"), ("tau_p", 0), ("tau_p", 1.5), ("tau_p", True), ("target_share", 1.0)],
)
def test_bad_settings_are_one_line_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=rf"algorithm\.stapo\.{key}"):
        build_config({"algorithm": {"stapo": {key: value}}})


def test_a_peaked_policy_examines_no_more_than_the_target_share():
    """Nearly every token in the top bin [0.89, 1]: the threshold stays below that bin
    instead of making every token a candidate."""
    gen = torch.Generator().manual_seed(3)
    p = torch.cat(
        [1 - 0.01 * torch.rand(9900, generator=gen, dtype=F64), random_probabilities(gen, 100)]
    )
    tau = RunningProbabilityThreshold(0.05, decay=0.0).update(probability_histogram(p))
    assert tau == pytest.approx(10 ** (-1 / BINS_PER_DECADE))
    assert 0 < float((p < tau).to(F64).mean()) < 0.05
