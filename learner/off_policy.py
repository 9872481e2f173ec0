"""Off-policy correction: importance weights from the behaviour to the proximal policy.

Decoupled PPO (Hilton et al., "Batch size-invariance for policy optimization", arXiv
2110.00641) gives the old policy of PPO two separate roles. The proximal policy anchors the
clip: here the learner's recomputed old_logp. The behaviour policy is the one that sampled:
vLLM's log-probs, up to k policy versions older when trainer.max_staleness = k, and computed
by other kernels (in bf16 on GPUs) even at staleness 0. Each token's policy loss is weighted by
w = pi_proximal / pi_behaviour, which corrects the expectation over samples drawn from the
behaviour policy. `algorithm.off_policy.mode` bounds w: truncated (tis) or masked (mis), per
token or per response. All weights are detached.

With mismatch-free samples every log-ratio is exactly 0, so every weight is exactly 1 in every
mode and level, and the update is the uncorrected one bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupflow.config.algorithm import OffPolicyConfig
from groupflow.learner.losses import kl_k3

# A ratio of e^50 is as good as infinite for any cap or band; clamping the log-ratio there keeps
# every weight and figure finite (a sequence's log-ratio sums over all its tokens).
MAX_LOG_RATIO = 50.0


@dataclass
class OffPolicyFigures:
    """Sums over one rank's valid tokens that carry the behaviour's log-probs."""

    tokens: int = 0
    weight: float = 0.0  # sum of w before truncation or masking
    weight_max: float = 0.0
    truncated: int = 0  # tokens whose w the cap lowered (tis)
    masked: int = 0  # tokens whose w left the band (mis)
    kl: float = 0.0  # k3 estimate of KL(behaviour || proximal) per token, summed

    def merge(self, other: OffPolicyFigures) -> OffPolicyFigures:
        """Every field adds except the max."""
        return OffPolicyFigures(
            tokens=self.tokens + other.tokens,
            weight=self.weight + other.weight,
            weight_max=max(self.weight_max, other.weight_max),
            truncated=self.truncated + other.truncated,
            masked=self.masked + other.masked,
            kl=self.kl + other.kl,
        )


@dataclass
class ImportanceWeights:
    weight: Tensor | None  # (B, T) detached w applied to A_it; None for mode none (w = 1)
    # The figures' sums, left on the device: a micro-batch planned on its own needs only the
    # weights, and reading the sums would stall the host once per micro-batch.
    sums: Tensor  # (6,) float64: tokens, weight, weight_max, truncated, masked, kl

    @property
    def figures(self) -> OffPolicyFigures:
        """The figures, read from the device (one synchronisation)."""
        tokens, weight_sum, weight_max, truncated, masked, kl = self.sums.tolist()
        return OffPolicyFigures(
            tokens=int(tokens),
            weight=weight_sum,
            weight_max=weight_max,
            truncated=int(truncated),
            masked=int(masked),
            kl=kl,
        )


def importance_weights(
    proximal_logp: Tensor,
    behaviour_logp: Tensor,
    known: Tensor,
    mask: Tensor,
    cfg: OffPolicyConfig,
) -> ImportanceWeights:
    """The weights of a padded mini-batch and their figures.

    proximal_logp, behaviour_logp, mask: (B, T); known: (B,) bool, rows whose behaviour
    log-probs came along (a row without them gets w = 1 and stays out of the figures).
    """
    valid = mask > 0
    measured = valid & known.unsqueeze(-1)
    token_log_ratio = torch.where(
        measured, proximal_logp.detach() - behaviour_logp.detach(), torch.zeros_like(proximal_logp)
    )
    log_ratio = token_log_ratio
    if cfg.level == "sequence":
        log_ratio = token_log_ratio.sum(-1, keepdim=True).expand_as(token_log_ratio)
    ratio = log_ratio.clamp(max=MAX_LOG_RATIO).exp()

    weight, truncated, masked = None, torch.zeros_like(measured), torch.zeros_like(measured)
    if cfg.mode == "tis":
        truncated = measured & (ratio > cfg.cap)
        weight = ratio.clamp(max=cfg.cap)
    elif cfg.mode == "mis":
        low, high = cfg.band
        masked = measured & ((ratio < low) | (ratio > high))
        weight = torch.where(masked, torch.zeros_like(ratio), ratio)

    # Sums over the measured tokens as sums of masked tensors, not of selections: a selection
    # has a data-dependent size, which the host must wait for. The ratios are >= 0, so a max
    # over zeros in the unmeasured places is the max over the measured ones (0 if none).
    wide = torch.where(measured, ratio.to(torch.float64), 0.0)
    kl = kl_k3(behaviour_logp.detach().to(torch.float64), proximal_logp.detach().to(torch.float64))
    parts = [
        measured.sum(),
        wide.sum(),
        wide.max() if wide.numel() else wide.new_zeros(()),
        truncated.sum(),
        masked.sum(),
        torch.where(measured, kl, 0.0).sum(),
    ]
    return ImportanceWeights(weight, torch.stack([t.to(torch.float64) for t in parts]))
