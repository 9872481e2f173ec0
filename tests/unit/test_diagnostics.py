"""Diagnostics (docs/algorithms.md, 'Diagnostics') and property 7, the logit-gradient identity."""

from __future__ import annotations

import pytest
import torch

from groupflow.learner.diagnostics import (
    CancellationResidual,
    cancellation_residual,
    logit_grad_norm_sq,
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
    assert cancellation_residual([group]).value == pytest.approx(
        (3 * first + 2 * second) / 5, rel=1e-6
    )
    assert cancellation_residual([group], whole_group=True).value == pytest.approx(first, rel=1e-6)


def test_residual_is_zero_when_shared_coefficients_cancel(gen):
    # Advantages on a dyadic grid that sum to exactly zero, and a power-of-two scale: every sum
    # the trie forms is exact in float64, so "cancels" means exactly 0, not 0 up to rounding.
    numerators = torch.randint(-1000, 1001, (4,), generator=gen, dtype=torch.int64)
    numerators[3] = -numerators[:3].sum()
    a = numerators.to(F64) / 1024
    c = 2.0**-5
    group = [
        ([7, 7, i + 10, 3], torch.tensor([c * a[i], c * a[i], 1.0, -2.0], dtype=F64))
        for i in range(4)
    ]
    assert cancellation_residual([group]).value == 0.0
    # Double the weight of the response with the largest |A| (a non-exchangeable weight): the
    # prefix is left with c A_k, at least 1/5 of its sum |g|.
    k = int(a.abs().argmax())
    group[k] = (group[k][0], group[k][1] * 2)
    assert cancellation_residual([group]).value >= 0.2 - 1e-12


def test_residual_without_shared_nodes_is_zero():
    assert cancellation_residual([]).value == 0.0
    group = [([1, 2], torch.tensor([0.5, 0.5])), ([2, 1], torch.tensor([0.5, 0.5]))]
    assert cancellation_residual([group]).value == 0.0
    # Identical tokens in DIFFERENT groups are different contexts (different prompts).
    assert cancellation_residual([[group[0]], [group[0]]]).value == 0.0
    # Shared nodes that carry no gradient neither cancel nor fail to.
    silent = [([1, 2], torch.tensor([0.0, 0.5])), ([1, 3], torch.tensor([0.0, 0.5]))]
    assert cancellation_residual([silent]).value == 0.0


def test_residual_accepts_tensor_ids_and_checks_lengths():
    group = [
        (torch.tensor([4, 5]), torch.tensor([1.0, 0.0])),
        (torch.tensor([4, 6]), torch.tensor([1.0, 0.0])),
    ]
    assert cancellation_residual([group]).value == 1.0
    with pytest.raises(ValueError, match="token ids"):
        cancellation_residual([[([1, 2, 3], torch.tensor([1.0, 2.0]))]])


def test_residual_sums_add_over_groups(gen):
    # Ranks hold whole groups and send only these sums: merging them must give the residual
    # of all groups at once. 12 groups x 8 responses x 60 tokens, long shared prefixes.
    groups = []
    for _ in range(12):
        stem = torch.randint(0, 20, (60,), generator=gen)
        group = []
        for cut in torch.randint(0, 60, (8,), generator=gen).tolist():
            ids = torch.cat([stem[:cut], torch.randint(0, 20, (60 - cut,), generator=gen)])
            group.append((ids.tolist(), torch.randn(60, generator=gen, dtype=F64)))
        groups.append(group)
    for whole_group in (False, True):
        at_once = cancellation_residual(groups, whole_group)
        split = torch.randint(1, len(groups), (), generator=gen).item()
        merged = cancellation_residual(groups[:split], whole_group).merge(
            cancellation_residual(groups[split:], whole_group)
        )
        assert merged.weight == at_once.weight > 0
        assert merged.value == pytest.approx(at_once.value, rel=1e-12)
        assert 0.0 < at_once.value < 1.0
    assert CancellationResidual().value == 0.0
