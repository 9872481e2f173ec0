"""Per-response advantage estimators (docs/algorithms.md, 'Advantage estimators').

Each estimator maps the rewards of a batch of groups (one group per prompt) to one
advantage per response. `compute_advantages` is the entry point; `ADVANTAGE_ESTIMATORS`
is the registry it dispatches through, one small function per method.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

STD_EPS = 1e-6

StdMode = Literal["unbiased", "biased", "none"]


@dataclass(frozen=True)
class GroupIndex:
    """Dense group membership of N items: item i belongs to group slot `slot[i]`.

    Group ids may be any int64 values; the slots are 0..num_groups-1.
    """

    slot: Tensor
    num_groups: int

    @classmethod
    def of(cls, group_ids: Tensor) -> GroupIndex:
        unique_ids, slot = torch.unique(group_ids, return_inverse=True)
        return cls(slot=slot, num_groups=unique_ids.numel())

    def sum(self, values: Tensor) -> Tensor:
        """Per-group sums of a [N] tensor, broadcast back to [N]."""
        totals = values.new_zeros(self.num_groups).index_add_(0, self.slot, values)
        return totals[self.slot]

    def size(self, dtype: torch.dtype) -> Tensor:
        """Size of each item's group, [N]."""
        return self.sum(torch.ones(self.slot.shape, dtype=dtype, device=self.slot.device))

    def mean(self, values: Tensor) -> Tensor:
        return self.sum(values) / self.size(values.dtype)

    def reduce(self, values: Tensor, how: Literal["amin", "amax"]) -> Tensor:
        """Per-group min or max of a [N] tensor, broadcast back to [N]."""
        out = values.new_zeros(self.num_groups)
        out = out.scatter_reduce(0, self.slot, values, reduce=how, include_self=False)
        return out[self.slot]

    def is_constant(self, values: Tensor) -> Tensor:
        """True for items whose group holds a single distinct value (size-1 groups too)."""
        return self.reduce(values, "amax") == self.reduce(values, "amin")


def grpo_advantages(
    rewards: Tensor,
    groups: GroupIndex,
    std: StdMode = "unbiased",
    token_counts: Tensor | None = None,
) -> Tensor:
    """GRPO (Shao et al., "DeepSeekMath", arXiv 2402.03300): (R - mean_g R) / (std_g R + 1e-6).

    `std` picks the unbiased (n - 1) or biased (n) group std, or none (no division).
    """
    centred = rewards - groups.mean(rewards)
    if std == "none":
        return centred
    # A size-1 group would divide by n - 1 = 0; compute_advantages zeroes it anyway.
    dof = groups.size(rewards.dtype) - (1.0 if std == "unbiased" else 0.0)
    group_std = (groups.sum(centred**2) / dof.clamp(min=1.0)).sqrt()
    return centred / (group_std + STD_EPS)


def dr_grpo_advantages(
    rewards: Tensor,
    groups: GroupIndex,
    std: StdMode = "unbiased",
    token_counts: Tensor | None = None,
) -> Tensor:
    """Dr. GRPO (Liu et al., "Understanding R1-Zero-Like Training", arXiv 2503.20783): R - mean_g R."""
    return rewards - groups.mean(rewards)


def rloo_advantages(
    rewards: Tensor,
    groups: GroupIndex,
    std: StdMode = "unbiased",
    token_counts: Tensor | None = None,
) -> Tensor:
    """RLOO (Ahmadian et al., "Back to Basics", arXiv 2402.14740): R_i - mean_{j != i} R_j."""
    others = (groups.size(rewards.dtype) - 1.0).clamp(min=1.0)
    return rewards - (groups.sum(rewards) - rewards) / others


def reinforce_baseline_advantages(
    rewards: Tensor,
    groups: GroupIndex,
    std: StdMode = "unbiased",
    token_counts: Tensor | None = None,
) -> Tensor:
    """REINFORCE++-baseline (Hu, "REINFORCE++", arXiv 2501.03262): R - mean_g R, then whitened.

    Whitening is over all valid tokens of the batch: response i counts token_counts[i] times
    in the (population) mean and std.
    """
    if token_counts is None:
        raise ValueError("reinforce_baseline whitens over tokens: pass token_counts")
    centred = rewards - groups.mean(rewards)
    weight = token_counts.to(rewards.dtype)
    total = weight.sum()
    if total <= 0:
        return torch.zeros_like(rewards)
    token_mean = (weight * centred).sum() / total
    token_std = ((weight * (centred - token_mean) ** 2).sum() / total).sqrt()
    return (centred - token_mean) / (token_std + STD_EPS)


AdvantageEstimator = Callable[[Tensor, GroupIndex, StdMode, Tensor | None], Tensor]

ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_baseline": reinforce_baseline_advantages,
}


def compute_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    estimator: str,
    std: StdMode = "unbiased",
    token_counts: Tensor | None = None,
) -> Tensor:
    """Per-response advantages [N] for rewards [N] grouped by group_ids [N] (int64).

    A group whose rewards are all equal (a size-1 group included) gets exactly 0: it carries
    no learning signal, and rounding in its mean must not turn into a push on its tokens.
    The result keeps the dtype of `rewards`.
    """
    if not rewards.is_floating_point():
        raise ValueError(f"rewards must be a floating-point tensor, got {rewards.dtype}")
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {estimator!r}; choose one of {sorted(ADVANTAGE_ESTIMATORS)}"
        )
    if rewards.numel() == 0:
        return rewards.clone()
    groups = GroupIndex.of(group_ids)
    advantages = ADVANTAGE_ESTIMATORS[estimator](rewards, groups, std, token_counts)
    return torch.where(groups.is_constant(rewards), torch.zeros_like(advantages), advantages)


def overlong_penalty(
    lengths: Tensor, max_tokens: int | Tensor, buffer_tokens: int, max_penalty: float
) -> Tensor:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13), added to the reward before
    the advantage: 0 up to `max_tokens - buffer_tokens` response tokens, then falling linearly
    to `-max_penalty` at `max_tokens`, so a response is told it runs long before it is cut."""
    free = max_tokens - buffer_tokens
    over = (lengths.to(torch.float64) - free).clamp(min=0.0, max=float(buffer_tokens))
    return -max_penalty * (over / buffer_tokens)  # the ratio first: exactly -max_penalty at the cap
