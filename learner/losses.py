"""Per-token policy losses and KL estimators (docs/algorithms.md, 'Policy losses').

All tensors are padded [B, T]; `mask` is 1.0 on valid response tokens and 0.0 on padding.
`token_loss` returns the per-token loss l_it; how tokens are weighted and summed
(aggregation, STAPO / Lopti / 20-Entropy masks) is the credit plan's job (learner.credit).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from groupflow.config.algorithm import AlgorithmConfig, ClipConfig


@dataclass
class TokenLoss:
    """Per-token loss and its diagnostics, all [B, T] and zero (False) at padding.

    loss: with gradient. A policy loss (POLICY_LOSSES) returns its own term l_it here;
    `token_loss` returns policy loss + kl.coef * kl - entropy_coef * entropy.
    clipped_low / clipped_high: the ratio left [1 - eps_low, 1 + eps_high] on the side where
    the clip removes the gradient for the sign of A (low with A < 0, high with A > 0).
    kl: the configured KL estimator against the reference policy, detached; zero without
    ref_logp (and always zero from a policy loss, which has no KL term).
    """

    loss: Tensor
    clipped_low: Tensor
    clipped_high: Tensor
    kl: Tensor

    @classmethod
    def policy_term(cls, loss: Tensor, clipped_low: Tensor, clipped_high: Tensor) -> TokenLoss:
        """A policy loss's own term, before token_loss adds KL and entropy."""
        return cls(loss, clipped_low, clipped_high, torch.zeros_like(loss).detach())


def _no_clipping(valid: Tensor) -> Tensor:
    return torch.zeros_like(valid)


def _clipped_sides(
    ratio: Tensor, adv: Tensor, valid: Tensor, clip: ClipConfig
) -> tuple[Tensor, Tensor]:
    ratio = ratio.detach()
    low = valid & (adv < 0) & (ratio < 1.0 - clip.eps_low)
    high = valid & (adv > 0) & (ratio > 1.0 + clip.eps_high)
    return low, high


def _clipped_surrogate(ratio: Tensor, adv: Tensor, clip: ClipConfig) -> Tensor:
    """-min(r A, clip(r) A), written as a max of the negated terms."""
    clipped_ratio = ratio.clamp(1.0 - clip.eps_low, 1.0 + clip.eps_high)
    return torch.maximum(-adv * ratio, -adv * clipped_ratio)


def ppo_loss(
    logp: Tensor, old_logp: Tensor, adv: Tensor, valid: Tensor, clip: ClipConfig
) -> TokenLoss:
    """PPO clipped surrogate (Schulman et al., arXiv 1707.06347) per token.

    Asymmetric range [1 - eps_low, 1 + eps_high] is DAPO's clip-higher (arXiv 2503.14476);
    the optional dual clip caps l at -c A for A < 0 (Ye et al., "Mastering Complex Control in
    MOBA Games", arXiv 1912.09729).
    """
    ratio = torch.exp(logp - old_logp)
    loss = _clipped_surrogate(ratio, adv, clip)
    clipped_low, clipped_high = _clipped_sides(ratio, adv, valid, clip)
    if clip.dual_clip is not None:
        cap = -clip.dual_clip * adv
        loss = torch.where(valid & (adv < 0) & (loss.detach() > cap), cap, loss)
    return TokenLoss.policy_term(loss, clipped_low, clipped_high)


def sequence_log_ratio(logp: Tensor, old_logp: Tensor, valid: Tensor) -> Tensor:
    """mean_t (logp - old_logp) over each row's valid tokens, [B]; 0 on an empty row."""
    diff = torch.where(valid, logp - old_logp, torch.zeros_like(logp))
    return diff.sum(-1) / valid.sum(-1).clamp(min=1)


def gspo_loss(
    logp: Tensor, old_logp: Tensor, adv: Tensor, valid: Tensor, clip: ClipConfig
) -> TokenLoss:
    """GSPO (Zheng et al., "Group Sequence Policy Optimization", arXiv 2507.18071), token form.

    s_i = exp(mean_t (logp - old_logp)) is clipped as a whole sequence. We use the paper's
    GSPO-token form s_it = sg[s_i] * exp(logp_it - sg[logp_it]): its value is s_i on every token
    (the sequence loss spread over tokens) and, for A_it = A_i, its gradient equals the sequence
    form under every aggregation here; unlike the sequence form it also respects per-token
    advantages (AR) and per-token masks (STAPO, Lopti), since a token's loss only moves itself.
    """
    seq_ratio = torch.exp(sequence_log_ratio(logp.detach(), old_logp, valid)).unsqueeze(-1)
    ratio = seq_ratio * torch.exp(logp - logp.detach())
    loss = _clipped_surrogate(ratio, adv, clip)
    clipped_low, clipped_high = _clipped_sides(seq_ratio.expand_as(logp), adv, valid, clip)
    return TokenLoss.policy_term(loss, clipped_low, clipped_high)


def linear_loss(
    logp: Tensor, old_logp: Tensor, adv: Tensor, valid: Tensor, clip: ClipConfig
) -> TokenLoss:
    """Clip-free on-policy policy gradient (Williams, REINFORCE, 1992): l = -A exp(logp - sg[logp]).

    Its value is -A and its gradient is -A grad logp, with no ratio to old_logp and no clipping,
    so the token gradient cancellation of arXiv 2604.13088 is not broken by a min/clip.
    """
    loss = -adv * torch.exp(logp - logp.detach())
    return TokenLoss.policy_term(loss, _no_clipping(valid), _no_clipping(valid))


def dfpo_loss(
    logp: Tensor, old_logp: Tensor, adv: Tensor, valid: Tensor, clip: ClipConfig
) -> TokenLoss:
    """dfpo (arXiv 2604.13088, docs/algorithms.md 'Policy losses'): l = -w~_i A_i logp.

    Our construction from the paper's description.

    The group-transformed sequence weight w~_i is folded into `adv` by the credit plan, so the
    token loss itself is the linear one.
    """
    return linear_loss(logp, old_logp, adv, valid, clip)


PolicyLoss = Callable[[Tensor, Tensor, Tensor, Tensor, ClipConfig], TokenLoss]

POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo": ppo_loss,
    "gspo": gspo_loss,
    "linear": linear_loss,
    "dfpo": dfpo_loss,
}


def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = logp - ref_logp (Schulman, "Approximating KL Divergence", 2020)."""
    return logp - ref_logp


def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = 0.5 (logp - ref_logp)^2 (Schulman, "Approximating KL Divergence", 2020)."""
    return 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = exp(ref - logp) - (ref - logp) - 1 (Schulman, 2020; as in GRPO, arXiv 2402.03300)."""
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1.0


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
}


def _zero_padding(values: Tensor, valid: Tensor) -> Tensor:
    # Padding may hold anything (even -inf); zeroing it first keeps exp() finite there, so
    # no NaN can leak into the loss or, through a 0 * inf, into the gradient.
    return torch.where(valid, values, torch.zeros_like(values))


def token_loss(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    cfg: AlgorithmConfig,
    ref_logp: Tensor | None = None,
    entropy: Tensor | None = None,
) -> TokenLoss:
    """Per-token loss l_it of `cfg.loss`, plus KL and entropy terms, [B, T] and zero at padding.

    adv is the per-token advantage A_it (the credit plan's token_adv). ref_logp is required
    when kl.coef > 0 and entropy (with gradient) when entropy_coef != 0.
    """
    if cfg.loss not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {cfg.loss!r}; choose one of {sorted(POLICY_LOSSES)}")
    valid = mask > 0
    logp = _zero_padding(logp, valid)
    terms = POLICY_LOSSES[cfg.loss](
        logp, _zero_padding(old_logp, valid), _zero_padding(adv, valid), valid, cfg.clip
    )
    loss = terms.loss
    kl = torch.zeros_like(logp, requires_grad=False)
    if ref_logp is not None:
        kl_with_grad = KL_ESTIMATORS[cfg.kl.estimator](logp, _zero_padding(ref_logp, valid))
        if cfg.kl.coef > 0:
            loss = loss + cfg.kl.coef * kl_with_grad
        kl = _zero_padding(kl_with_grad.detach(), valid)
    elif cfg.kl.coef > 0:
        raise ValueError("kl.coef > 0 needs ref_logp")
    if cfg.entropy_coef != 0:
        if entropy is None:
            raise ValueError("entropy_coef != 0 needs the per-token entropy (with gradient)")
        loss = loss - cfg.entropy_coef * _zero_padding(entropy, valid)
    return TokenLoss(
        loss=_zero_padding(loss, valid),
        clipped_low=terms.clipped_low,
        clipped_high=terms.clipped_high,
        kl=kl,
    )
