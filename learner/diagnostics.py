"""Diagnostics that make the token-credit theory visible (docs/algorithms.md,
'Diagnostics'): the logit-gradient norm behind STAPO and the low-probability shares, and the
token gradient cancellation residual. The other per-step figures are sums kept in learner/figures.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass
class CancellationResidual:
    """The residual's sums: it adds over groups, so ranks (which hold whole groups) add theirs."""

    weighted_ratio: float = 0.0  # sum over shared nodes of (responses through it) |sum g| / sum |g|
    weight: float = 0.0  # sum over the same nodes of the responses through them

    @property
    def value(self) -> float:
        """Occurrence-weighted mean of |sum g| / sum |g|; 0.0 when no node is shared."""
        return self.weighted_ratio / self.weight if self.weight else 0.0

    def merge(self, other: CancellationResidual) -> CancellationResidual:
        return CancellationResidual(
            self.weighted_ratio + other.weighted_ratio, self.weight + other.weight
        )


def cancellation_residual(
    groups: Sequence[Sequence[ResponseCoefficients]], whole_group: bool = False
) -> CancellationResidual:
    """Occurrence-weighted |sum g| / sum |g| over prefix-trie nodes shared by >= 2 responses.

    groups: per group, one (response token ids, g) per response, g_t = dLoss/dlogp_t. A node
    with n responses through it contributes its ratio with weight n; nodes carrying no gradient
    (sum |g| = 0) neither cancel nor fail to and are left out.

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
    return CancellationResidual(weighted_ratio, float(weight))
