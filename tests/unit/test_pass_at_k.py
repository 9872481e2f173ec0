"""pass@k's unbiased estimator against counting every k-subset, exactly."""

import random
from fractions import Fraction
from itertools import combinations

import pytest

from groupflow.loop.held_out import greedy_share, pass_at_k, sampled_scores


def _by_enumeration(n: int, correct: int, k: int) -> Fraction:
    outcomes = [True] * correct + [False] * (n - correct)
    subsets = list(combinations(outcomes, k))
    return Fraction(sum(any(s) for s in subsets), len(subsets))


def test_matches_the_share_of_k_subsets_with_a_pass():
    rng = random.Random()
    for _ in range(200):
        n = rng.randint(1, 14)
        k, correct = rng.randint(1, n), rng.randint(0, n)
        assert pass_at_k(n, correct, k) == pytest.approx(
            float(_by_enumeration(n, correct, k)), abs=1e-12
        )


def test_large_n_stays_finite_and_in_range():
    rng = random.Random()
    n = rng.randint(500, 5000)
    value = pass_at_k(n, rng.randint(0, n), rng.randint(1, n))
    assert 0.0 <= value <= 1.0


@pytest.mark.parametrize("n, c, k", [(4, 1, 0), (4, 1, 5), (4, 5, 2), (4, -1, 2)])
def test_impossible_counts_are_refused(n, c, k):
    with pytest.raises(ValueError, match="pass@"):
        pass_at_k(n, c, k)


def test_scores_average_over_prompts():
    rng = random.Random()
    n, prompts = rng.randint(2, 8), rng.randint(1, 6)
    rewards = [[float(rng.random() < 0.4) for _ in range(n)] for _ in range(prompts)]
    mean, pass_1 = sampled_scores(rewards, 1)
    assert mean == pytest.approx(sum(map(sum, rewards)) / (n * prompts))
    assert pass_1 == pytest.approx(mean)  # pass@1 of 0/1 rewards is the mean pass rate
    _, pass_n = sampled_scores(rewards, n)
    assert pass_n == pytest.approx(sum(any(row) for row in rewards) / prompts)
    assert greedy_share([[r[0]] for r in rewards]) == sum(r[0] >= 1 for r in rewards) / prompts
