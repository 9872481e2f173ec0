"""Diagnostics that make the token-credit theory visible (ALGORITHMS.md section 5).

Inputs are padded [B, T] tensors with a float mask (1.0 on valid response tokens). The helpers
return rank-local Python floats; a mean over ranks is the learner's to weight by token counts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

ResponseCoefficients = tuple[Sequence[int], Tensor]


def logit_grad_norm_sq(p_token: Tensor, sum_p2: Tensor) -> Tensor:
    """||d log p(y) / d logits||^2 = 1 - 2 p(y) + sum_j p_j^2 (STAPO, arXiv 2602.15620).

    The gradient of log softmax(z)_y is onehot(y) - p; the norm is largest for a low-probability
    token in a peaked (low-entropy) distribution.
    """
    return 1.0 - 2.0 * p_token + sum_p2


def _trie_node_sums(group: Sequence[ResponseCoefficients]) -> list[tuple[int, float, float]]:
    """(responses through the node, sum g, sum |g|) for every node of the group's prefix trie.

    A node is (parent node, token): two responses reach the same node exactly when their
    tokens up to and including this one are identical, i.e. the same token in the same context.
    """
    child: dict[tuple[int, int], int] = {}
    counts: list[int] = []
    sums: list[float] = []
    abs_sums: list[float] = []
    for token_ids, g in group:
        ids = token_ids.tolist() if isinstance(token_ids, Tensor) else list(token_ids)
        coefficients = g.detach().reshape(-1).tolist()
        if len(ids) != len(coefficients):
            raise ValueError(f"{len(ids)} token ids but {len(coefficients)} gradient coefficients")
        node = -1  # the root: the prompt, shared by the whole group
        for token, c in zip(ids, coefficients, strict=True):
            node = child.setdefault((node, token), len(counts))
            if node == len(counts):
                counts.append(0)
                sums.append(0.0)
                abs_sums.append(0.0)
            counts[node] += 1
            sums[node] += c
            abs_sums[node] += abs(c)
    return list(zip(counts, sums, abs_sums, strict=True))


def cancellation_residual(
    groups: Sequence[Sequence[ResponseCoefficients]], whole_group: bool = False
) -> float:
    """Occurrence-weighted |sum g| / sum |g| over prefix-trie nodes shared by >= 2 responses.

    groups: per group, one (response token ids, g) per response, g_t = dLoss/dlogp_t. A node
    with n responses through it contributes its ratio with weight n; nodes carrying no gradient
    (sum |g| = 0) neither cancel nor fail to and are left out. 0.0 when nothing is shared.

    The ratio is exactly 0 for an exchangeable aggregation only on nodes shared by the WHOLE
    group (there sum_i A_i = 0); a node shared by a strict subset keeps that subset's net
    advantage, which is genuine credit. `whole_group=True` restricts to those nodes.
    """
    weighted_ratio = 0.0
    weight = 0
    for group in groups:
        min_share = max(2, len(group)) if whole_group else 2
        for count, total, abs_total in _trie_node_sums(group):
            if count >= min_share and abs_total > 0:
                weighted_ratio += count * abs(total) / abs_total
                weight += count
    return weighted_ratio / weight if weight else 0.0


def masked_mean(values: Tensor, mask: Tensor) -> float:
    """Mean of `values` over mask > 0; NaN when the mask is empty (no data, not zero)."""
    selected = values.detach()[mask > 0]
    return selected.mean().item() if selected.numel() else math.nan


def entropy_mean_pos(entropy: Tensor, mask: Tensor, advantages: Tensor) -> float:
    """Mean token entropy over responses with A > 0."""
    return masked_mean(entropy, (mask > 0) & (advantages.unsqueeze(-1) > 0))


def entropy_mean_neg(entropy: Tensor, mask: Tensor, advantages: Tensor) -> float:
    """Mean token entropy over responses with A < 0."""
    return masked_mean(entropy, (mask > 0) & (advantages.unsqueeze(-1) < 0))


def clip_fractions(clipped_low: Tensor, clipped_high: Tensor, mask: Tensor) -> tuple[float, float]:
    """(low, high) fractions of valid tokens whose clip was active (TokenLoss.clipped_*)."""
    return masked_mean(clipped_low.to(torch.float64), mask), masked_mean(
        clipped_high.to(torch.float64), mask
    )


def approx_kl(
    logp: Tensor, old_logp: Tensor, mask: Tensor, estimator: Literal["k2", "k3"] = "k3"
) -> float:
    """Approximate KL(old || new) over valid tokens, on tokens sampled from the old policy.

    k3 (default, unbiased, >= 0): r - 1 - log r with r = exp(logp - old_logp);
    k2: 0.5 (logp - old_logp)^2 (biased, low variance). Schulman, "Approximating KL
    Divergence", 2020.
    """
    log_ratio = (logp.detach() - old_logp.detach()).to(torch.float64)
    log_ratio = torch.where(mask > 0, log_ratio, torch.zeros_like(log_ratio))
    if estimator == "k2":
        per_token = 0.5 * log_ratio**2
    elif estimator == "k3":
        per_token = torch.expm1(log_ratio) - log_ratio
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; choose k2 or k3")
    return masked_mean(per_token, mask)
