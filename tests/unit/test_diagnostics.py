"""Diagnostics (ALGORITHMS.md section 5) and property 7, the logit-gradient identity."""

from __future__ import annotations

import math
import time

import pytest
import torch

from groupflow.learner.diagnostics import (
    approx_kl,
    cancellation_residual,
    clip_fractions,
    entropy_mean_neg,
    entropy_mean_pos,
    logit_grad_norm_sq,
    masked_mean,
)

F64 = torch.float64


# ----- property 7: ||d log p(y) / d logits||^2 = 1 - 2 p(y) + sum_j p_j^2 ---------------------


def test_logit_gradient_identity_under_autograd(gen):
    rows, vocab = 64, 1 + torch.randint(1, 50, (), generator=gen).item()
    logits = (3 * torch.randn(rows, vocab, generator=gen, dtype=F64)).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    logp = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    # Rows are independent, so the gradient of the sum holds each row's own gradient.
    grad = torch.autograd.grad(logp.sum(), logits)[0]
    p = torch.softmax(logits.detach(), -1)
    expected = logit_grad_norm_sq(p.gather(-1, targets[:, None]).squeeze(-1), (p * p).sum(-1))
    torch.testing.assert_close((grad * grad).sum(-1), expected, rtol=1e-12, atol=1e-14)


def test_logit_gradient_is_largest_for_low_p_and_low_entropy():
    # Same p(y) = 0.01; the rest either peaked on one token (low entropy) or spread out.
    peaked = logit_grad_norm_sq(torch.tensor(0.01), torch.tensor(0.01**2 + 0.99**2))
    spread = logit_grad_norm_sq(torch.tensor(0.01), torch.tensor(0.01**2 + 99 * 0.01**2))
    likely = logit_grad_norm_sq(torch.tensor(0.99), torch.tensor(0.99**2 + 0.01**2))
    assert peaked > spread > likely
    assert peaked.item() == pytest.approx(1 - 0.02 + 0.0001 + 0.9801)


# ----- cancellation residual -----------------------------------------------------------------


def test_residual_on_a_hand_built_group():
    g = [torch.tensor([0.5, -0.2, 0.1]), torch.tensor([-0.3, 0.4, 0.7]), torch.tensor([-0.1, 0.9])]
    group = [([1, 2, 3], g[0]), ([1, 2, 4], g[1]), ([1, 5], g[2])]
    # Node "1" is shared by all three, node "1,2" by the first two; the rest are single.
    first = abs(0.5 - 0.3 - 0.1) / (0.5 + 0.3 + 0.1)
    second = abs(-0.2 + 0.4) / (0.2 + 0.4)
    assert cancellation_residual([group]) == pytest.approx((3 * first + 2 * second) / 5, rel=1e-6)
    assert cancellation_residual([group], whole_group=True) == pytest.approx(first, rel=1e-6)


def test_residual_is_zero_when_shared_coefficients_cancel(gen):
    a = torch.randn(4, generator=gen, dtype=F64)
    a = a - a.mean()
    c = 0.03
    group = [
        ([7, 7, i + 10, 3], torch.tensor([c * a[i], c * a[i], 1.0, -2.0], dtype=F64))
        for i in range(4)
    ]
    assert cancellation_residual([group]) <= 1e-15
    # Double the weight of the response with the largest |A| (a non-exchangeable weight): the
    # prefix is left with c A_k, at least 1/5 of its sum |g|.
    k = int(a.abs().argmax())
    group[k] = (group[k][0], group[k][1] * 2)
    assert cancellation_residual([group]) >= 0.2 - 1e-12


def test_residual_without_shared_nodes_is_zero():
    assert cancellation_residual([]) == 0.0
    group = [([1, 2], torch.tensor([0.5, 0.5])), ([2, 1], torch.tensor([0.5, 0.5]))]
    assert cancellation_residual([group]) == 0.0
    # Identical tokens in DIFFERENT groups are different contexts (different prompts).
    assert cancellation_residual([[group[0]], [group[0]]]) == 0.0
    # Shared nodes that carry no gradient neither cancel nor fail to.
    silent = [([1, 2], torch.tensor([0.0, 0.5])), ([1, 3], torch.tensor([0.0, 0.5]))]
    assert cancellation_residual([silent]) == 0.0


def test_residual_accepts_tensor_ids_and_checks_lengths():
    group = [
        (torch.tensor([4, 5]), torch.tensor([1.0, 0.0])),
        (torch.tensor([4, 6]), torch.tensor([1.0, 0.0])),
    ]
    assert cancellation_residual([group]) == 1.0
    with pytest.raises(ValueError, match="token ids"):
        cancellation_residual([[([1, 2, 3], torch.tensor([1.0, 2.0]))]])


def test_residual_is_fast_enough_for_a_real_step(gen):
    # 64 groups x 16 responses x 200 tokens, with long shared prefixes inside each group.
    groups = []
    for _ in range(64):
        stem = torch.randint(0, 50, (200,), generator=gen)
        cuts = torch.randint(0, 200, (16,), generator=gen)
        group = []
        for cut in cuts.tolist():
            ids = torch.cat([stem[:cut], torch.randint(0, 50, (200 - cut,), generator=gen)])
            group.append((ids.tolist(), torch.randn(200, generator=gen, dtype=F64)))
        groups.append(group)
    start = time.perf_counter()
    value = cancellation_residual(groups)
    assert time.perf_counter() - start < 10.0
    assert 0.0 < value < 1.0


# ----- per-step helpers ------------------------------------------------------------------------


def padded(gen: torch.Generator, rows: int = 6, width: int = 5):
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    mask = (torch.arange(width) < lengths[:, None]).to(F64)
    return mask, [(i, t) for i in range(rows) for t in range(width) if mask[i, t] > 0]


def test_entropy_means_by_advantage_sign(gen):
    mask, cells = padded(gen)
    entropy = torch.rand(mask.shape, generator=gen, dtype=F64)
    advantages = torch.tensor([1.0, -1.0, 0.0, 2.0, -0.5, 1.0], dtype=F64)
    for fn, keep in ((entropy_mean_pos, lambda a: a > 0), (entropy_mean_neg, lambda a: a < 0)):
        values = [entropy[i, t].item() for i, t in cells if keep(advantages[i].item())]
        assert fn(entropy, mask, advantages) == pytest.approx(sum(values) / len(values))
    assert math.isnan(entropy_mean_pos(entropy, mask, -advantages.abs()))  # no data, not 0


def test_clip_fractions(gen):
    mask, cells = padded(gen)
    low = torch.rand(mask.shape, generator=gen) < 0.3
    high = torch.rand(mask.shape, generator=gen) < 0.3
    got = clip_fractions(low, high, mask)
    expected = tuple(sum(x[c].item() for c in cells) / len(cells) for x in (low, high))
    assert got == pytest.approx(expected)


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_approx_kl_matches_loop(gen, estimator):
    mask, cells = padded(gen)
    old = -3 * torch.rand(mask.shape, generator=gen, dtype=F64)
    new = old + 0.3 * torch.randn(mask.shape, generator=gen, dtype=F64)
    new[mask == 0] = float("nan")
    values = []
    for c in cells:
        d = new[c].item() - old[c].item()
        values.append(0.5 * d * d if estimator == "k2" else math.exp(d) - 1 - d)
    assert approx_kl(new, old, mask, estimator) == pytest.approx(
        sum(values) / len(values), rel=1e-12
    )
    with pytest.raises(ValueError):
        approx_kl(new, old, mask, "k1")


def test_masked_mean_ignores_padding(gen):
    mask, cells = padded(gen)
    values = torch.randn(mask.shape, generator=gen, dtype=F64).masked_fill(mask == 0, float("inf"))
    assert masked_mean(values, mask) == pytest.approx(
        sum(values[c].item() for c in cells) / len(cells)
    )
