"""Token-credit transforms and aggregation for one mini-batch (docs/algorithms.md,
'Aggregation', 'Token-credit transforms', 'Diagnostics').

`plan_credit` turns one rank's share of a mini-batch into a `CreditPlan`: the per-token
advantages A_it (after AR and the dfpo sequence weight) and, per optimizer pass, a detached
coefficient c_it that already holds the masks (STAPO, 20-Entropy, Lopti) and 1/denominator of
the aggregation. Lopti makes two passes (two optimizer updates) over a mini-batch, everything
else one. The learner's loss for a micro-batch in a pass is then
`(pass_coef * token_loss(...).loss).sum()`, summed over micro-batches and ranks.

Denominators are global to the mini-batch (one optimizer update): a token count divided per
micro-batch or per rank would give the responses of one group different weights and break the
token gradient cancellation of arXiv 2604.13088. Groups are rank-local, counts are not, so the
plan needs one sum of a small vector across ranks, a max for the `constant` mode, and a gather
of entropies only where a quantile is taken.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from groupflow.config.algorithm import AlgorithmConfig
from groupflow.learner.advantages import GroupIndex
from groupflow.learner.auto_threshold import RunningProbabilityThreshold, probability_histogram
from groupflow.learner.diagnostics import logit_grad_norm_sq
from groupflow.learner.losses import sequence_log_ratio
from groupflow.learner.off_policy import (
    ImportanceWeights,
    OffPolicyFigures,
    importance_weights,
)


@dataclass
class MiniBatchTokens:
    """The sequences one rank holds in a mini-batch, padded; every group lies wholly on one rank.

    old_* come from the proximal policy (the learner's weights at the start of the step),
    cur_* from the current one, all detached; on the first mini-batch of a step they are equal.
    behaviour_logp is the sampler's (vLLM's) log-prob of each token, for the off-policy
    correction (learner/off_policy.py); None, or a row whose behaviour_known is False, means
    it did not come along, and the proximal policy stands in for it (weight 1).
    """

    mask: Tensor  # (B, T) 1.0 on response tokens, 0.0 on padding
    old_logp: Tensor  # (B, T)
    cur_logp: Tensor  # (B, T)
    old_entropy: Tensor  # (B, T)
    cur_entropy: Tensor  # (B, T)
    cur_sum_p2: Tensor  # (B, T) sum_j p_j^2 of the current policy
    advantages: Tensor  # (B,) A_i
    group_ids: Tensor  # (B,) int64
    behaviour_logp: Tensor | None = None  # (B, T)
    behaviour_known: Tensor | None = None  # (B,) bool

    def __post_init__(self) -> None:
        if (self.behaviour_logp is None) != (self.behaviour_known is None):
            raise ValueError("behaviour_logp and behaviour_known come together or not at all")
        shape = self.mask.shape
        per_token = ("old_logp", "cur_logp", "old_entropy", "cur_entropy", "cur_sum_p2")
        per_row = ("advantages", "group_ids")
        if self.behaviour_logp is not None:
            per_token, per_row = (*per_token, "behaviour_logp"), (*per_row, "behaviour_known")
        for names, want in ((per_token, shape), (per_row, shape[:1])):
            for name in names:
                if getattr(self, name).shape != want:
                    raise ValueError(
                        f"{name}: shape {tuple(getattr(self, name).shape)} != {tuple(want)}"
                    )


class Reducer(Protocol):
    """Collectives over the learner ranks. Every rank must make the same calls in the same order."""

    world_size: int

    def sum(self, t: Tensor) -> Tensor:
        """Elementwise sum over ranks."""
        ...

    def max(self, t: Tensor) -> Tensor:
        """Elementwise max over ranks."""
        ...

    def gather(self, t: Tensor) -> Tensor:
        """Concatenation of a 1-d tensor over ranks, in rank order; lengths may differ (even 0)."""
        ...


@dataclass
class LocalReducer:
    """A single process: every collective is the identity."""

    world_size: int = 1

    def sum(self, t: Tensor) -> Tensor:
        return t

    def max(self, t: Tensor) -> Tensor:
        return t

    def gather(self, t: Tensor) -> Tensor:
        return t


@dataclass
class CreditStats:
    """A mini-batch's credit figures, global over ranks (every rank computes the same)."""

    valid_tokens: float
    num_sequences: float
    trained_frac: float  # valid tokens left by STAPO and 20-Entropy
    spurious_frac: float  # what STAPO silences, or would silence when it is off
    stapo_tau_p: float  # the probability threshold it used (set by the data with tau_p: auto)
    stapo_silenced_frac: float
    lowprob_frac: float  # p < lowprob_eta under the current policy
    lowprob_grad_share: float  # share of the logit-gradient norm from those tokens
    optimizer_passes: float  # 2 with Lopti (unless a side is empty), else 1


@dataclass
class CreditRows:
    """What the loss of a micro-batch reads from a plan, one row per sequence."""

    token_adv: Tensor  # (B, T) A_it, the importance weight of the off-policy correction included
    passes: list[Tensor]  # one (B, T) detached c_it per optimizer pass, in order


@dataclass
class CreditPlan(CreditRows):
    """The credit of one rank's share of a mini-batch, rows in the order of its sequences."""

    stats: CreditStats
    # Rank-local sums (unlike stats), over the whole mini-batch: a split keeps none.
    off_policy: OffPolicyFigures = field(default_factory=OffPolicyFigures)

    def split(self, sizes: list[int]) -> list[CreditRows]:
        """The rows of consecutive blocks of `sizes` rows (the micro-batches), as views."""
        if sum(sizes) != self.token_adv.shape[0]:
            raise ValueError(
                f"micro-batch sizes {sizes} do not add up to {self.token_adv.shape[0]} rows"
            )
        per_pass = [coef.split(sizes) for coef in self.passes]
        return [
            CreditRows(adv, [rows[k] for rows in per_pass])
            for k, adv in enumerate(self.token_adv.split(sizes))
        ]


def ar_weight(old_logp: Tensor, alpha: float) -> Tensor:
    """Advantage Reweighting (Yang et al., "Do Not Let Low-Probability Tokens Over-Dominate in
    RL for LLMs", arXiv 2505.12929): A_it <- (alpha * p_old + 1 - alpha) A_it.

    Written as 1 - alpha (1 - p) so rounding keeps it in [1 - alpha, 1], monotone in p_old,
    and exactly 1 for alpha = 0. Detached.
    """
    return 1.0 - alpha * (1.0 - old_logp.detach().exp())


def stapo_mask(
    p: Tensor,
    entropy: Tensor,
    advantages: Tensor,
    mask: Tensor,
    tau_p: float,
    quantile: float,
    reducer: Reducer | None = None,
) -> Tensor:
    """STAPO spurious tokens (arXiv 2602.15620): the bool [B, T] set of tokens to silence.

    Candidates are valid tokens of positive-advantage responses with p < tau_p; tau_h is the
    `quantile` of the entropy over the candidates of the whole mini-batch (all ranks); the
    candidates with entropy < tau_h are silenced.
    """
    candidates = (mask > 0) & (advantages.unsqueeze(-1) > 0) & (p < tau_p)
    candidate_entropy = _reducer(reducer).gather(entropy[candidates])
    if candidate_entropy.numel() == 0:
        return candidates
    return candidates & _clearly_below(entropy, _quantile(candidate_entropy, quantile))


def lopti_split(p_old: Tensor, mask: Tensor, eta: float) -> tuple[Tensor, Tensor]:
    """Lopti (arXiv 2505.12929): valid tokens split into (low, high) by p_old < |eta| (strict).

    A token with p_old = |eta| is high. The sign of eta only sets the pass order (plan_credit).
    """
    valid = mask > 0
    low = valid & (p_old < abs(eta))
    return low, valid & ~low


def entropy_top_mask(
    entropy: Tensor, mask: Tensor, rho: float, reducer: Reducer | None = None
) -> Tensor:
    """20-Entropy (Wang et al., "Beyond the 80/20 Rule", arXiv 2506.01939): the bool [B, T]
    set of valid tokens to keep, those with entropy >= the (1 - rho) quantile over the valid
    tokens of the whole mini-batch (all ranks).
    """
    valid = mask > 0
    all_entropy = _reducer(reducer).gather(entropy[valid])
    if all_entropy.numel() == 0:
        return valid
    return valid & ~_clearly_below(entropy, _quantile(all_entropy, 1.0 - rho))


def sequence_weight(cur_logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """dfpo's w_i = sg[s_i], s_i = exp(mean_t (cur_logp - old_logp)), [B].

    docs/algorithms.md, 'Policy losses' (dfpo).
    """
    return torch.exp(sequence_log_ratio(cur_logp.detach(), old_logp.detach(), mask > 0))


def min_replace(w: Tensor, adv: Tensor, group_ids: Tensor) -> Tensor:
    """Token gradient cancellation fix (arXiv 2604.13088): w~_i = min_{j in group} w_j.

    One weight per group makes the coefficient exchangeable, so A.w~ = (min w) sum A = 0.
    Detached.
    """
    return GroupIndex.of(group_ids).reduce(w.detach(), "amin")


def adv_orthogonal(w: Tensor, adv: Tensor, group_ids: Tensor) -> Tensor:
    """Token gradient cancellation fix (arXiv 2604.13088): per group w~ = w - (A.w / |A|^2) A.

    Removes from w its component along A, so A.w~ = 0; a group with A = 0 keeps w. Detached.
    """
    w, adv = w.detach(), adv.detach().to(w.dtype)
    groups = GroupIndex.of(group_ids)
    adv_norm_sq = groups.sum(adv * adv)
    projection = groups.sum(adv * w) / torch.where(
        adv_norm_sq > 0, adv_norm_sq, torch.ones_like(adv_norm_sq)
    )
    return w - projection * adv


DFPO_WEIGHT_TRANSFORMS: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "min_replace": min_replace,
    "adv_orthogonal": adv_orthogonal,
}


# Tokens that share a context within a group (a shared prefix) have one entropy, so a quantile
# often lands on a value several tokens hold. Batched differently (other micro-batches, other
# ranks, another padded width), those copies differ in the last bits, and a strict comparison
# would then let the layout decide which copies a mask keeps. Within this relative margin a
# value counts as equal to the quantile.
QUANTILE_TIE_REL = 1e-9


def _clearly_below(values: Tensor, threshold: Tensor) -> Tensor:
    return values < threshold - QUANTILE_TIE_REL * threshold.abs()


def _quantile(values: Tensor, q: float) -> Tensor:
    """torch.quantile's linear interpolation, without its 16M-element limit: 20-Entropy takes
    the quantile over every valid token of a mini-batch, which can be larger than that."""
    ordered = values.sort().values
    # The position in the values' dtype, as torch.quantile does, so both agree to the bit.
    position = torch.tensor(q, dtype=values.dtype) * (ordered.numel() - 1)
    below = int(position)
    above = min(below + 1, ordered.numel() - 1)
    return torch.lerp(ordered[below], ordered[above], (position - below).to(values.device))


def _reducer(reducer: Reducer | None) -> Reducer:
    return LocalReducer() if reducer is None else reducer


def _probs(logp: Tensor, valid: Tensor) -> Tensor:
    """exp(logp) on valid tokens, 0 on padding (which may hold anything)."""
    return torch.where(valid, logp.detach(), torch.full_like(logp, float("-inf"))).exp()


def token_advantages(tokens: MiniBatchTokens, cfg: AlgorithmConfig) -> Tensor:
    """A_it [B, T]: A_i broadcast to valid tokens, times AR's weight and dfpo's w~_i."""
    valid = tokens.mask > 0
    dtype = tokens.old_logp.dtype
    adv = tokens.advantages.to(dtype).unsqueeze(-1).expand_as(tokens.mask)
    adv = adv * ar_weight(tokens.old_logp, cfg.ar.alpha)
    if cfg.loss == "dfpo":
        w = sequence_weight(tokens.cur_logp, tokens.old_logp, tokens.mask)
        transform = DFPO_WEIGHT_TRANSFORMS[cfg.dfpo.weight_transform]
        adv = adv * transform(w, tokens.advantages, tokens.group_ids).to(dtype).unsqueeze(-1)
    return torch.where(valid, adv, torch.zeros_like(adv))


def _stapo_source(
    tokens: MiniBatchTokens, cfg: AlgorithmConfig, valid: Tensor
) -> tuple[Tensor, Tensor]:
    if cfg.stapo.prob_source == "old":
        return _probs(tokens.old_logp, valid), tokens.old_entropy
    return _probs(tokens.cur_logp, valid), tokens.cur_entropy


def _off_policy(tokens: MiniBatchTokens, cfg: AlgorithmConfig) -> ImportanceWeights:
    """Decoupled PPO's importance weights, proximal (old_logp) over behaviour policy.

    They multiply A_it, after AR and dfpo: the policy-gradient term is what they correct (the KL
    and entropy terms are regularisers on every token). A weight is never negative, so it
    keeps the sign every clip and mask reads; a masked token's weight is 0 and it stays in
    the denominator, which is why the global token count does not depend on the correction.
    """
    behaviour, known = tokens.behaviour_logp, tokens.behaviour_known
    if behaviour is None:
        behaviour = tokens.old_logp
        known = torch.zeros(tokens.mask.shape[0], dtype=torch.bool, device=tokens.mask.device)
    return importance_weights(tokens.old_logp, behaviour, known, tokens.mask, cfg.off_policy)


def _pass_masks(tokens: MiniBatchTokens, cfg: AlgorithmConfig, valid: Tensor) -> list[Tensor]:
    """Which valid tokens each optimizer pass trains, in order, before other masks."""
    if not cfg.lopti.enabled:
        return [valid]
    low, high = lopti_split(_probs(tokens.old_logp, valid), tokens.mask, cfg.lopti.eta)
    return [low, high] if cfg.lopti.eta >= 0 else [high, low]


def _row_weight(aggregation: str, unmasked: Tensor) -> Tensor:
    """The rank-local part of c_it, [B, 1]: 1/|o_i| for seq_mean_token_mean, else 1.

    |o_i| counts the tokens STAPO left, so STAPO renormalises each sequence's mean.
    """
    if aggregation != "seq_mean_token_mean":
        return torch.ones_like(unmasked[:, :1], dtype=torch.float64)
    counts = unmasked.sum(-1, keepdim=True).to(torch.float64)
    return torch.where(counts > 0, 1.0 / counts.clamp(min=1), torch.zeros_like(counts))


def _global_scale(aggregation: str, totals: dict[str, float], max_length: float) -> float:
    """The global part of c_it: 1 / the aggregation's mini-batch denominator (0 if empty)."""
    denominator = {
        "token_mean": totals["unmasked_tokens"],
        "seq_mean_token_sum": totals["sequences"],
        "seq_mean_token_mean": totals["sequences"],
        "constant": totals["sequences"] * max_length,
    }[aggregation]
    return 1.0 / denominator if denominator > 0 else 0.0


def _sum_over_ranks(reducer: Reducer, local: dict[str, Tensor]) -> dict[str, float]:
    """One all-reduce of all named scalar sums, in float64 so token counts stay exact."""
    stacked = torch.stack([value.to(torch.float64).reshape(()) for value in local.values()])
    return dict(zip(local, reducer.sum(stacked).tolist(), strict=True))


def _max_length(reducer: Reducer, lengths: Tensor) -> float:
    lengths = lengths.to(torch.float64)
    local_max = lengths.max() if lengths.numel() else lengths.new_zeros(())
    return float(reducer.max(local_max.reshape(1)).item())


def _fraction(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else 0.0


def _corrected_advantages(
    tokens: MiniBatchTokens, cfg: AlgorithmConfig
) -> tuple[Tensor, ImportanceWeights]:
    """A_it with the off-policy correction's importance weight, and that correction."""
    token_adv = token_advantages(tokens, cfg)
    correction = _off_policy(tokens, cfg)
    if correction.weight is not None:
        token_adv = token_adv * correction.weight.to(token_adv.dtype)
    return token_adv, correction


def plans_per_micro_batch(cfg: AlgorithmConfig) -> bool:
    """Whether every token's c_it and A_it depend only on its own sequence and on counts the
    response lengths give: no quantile over the mini-batch (STAPO, 20-Entropy), no weight
    shared by a group (dfpo's), no Lopti split (whose empty passes are dropped). Then each
    micro-batch is planned from its own forward as it runs (`micro_batch_rows`), and no
    forward is spent on statistics alone (learner/step.py)."""
    return not (
        cfg.stapo.enabled or cfg.entropy_mask.enabled or cfg.lopti.enabled or cfg.loss == "dfpo"
    )


def length_scale(aggregation: str, lengths: list[int], reducer: Reducer) -> float:
    """The global part of c_it from this rank's response lengths in a mini-batch: what
    plan_credit computes when no token is masked (collectives: one sum, and a max for
    `constant`)."""
    counts = torch.tensor(lengths, dtype=torch.float64)
    totals = _sum_over_ranks(
        reducer, {"unmasked_tokens": counts.sum(), "sequences": (counts > 0).sum()}
    )
    max_length = _max_length(reducer, counts) if aggregation == "constant" else 0.0
    return _global_scale(aggregation, totals, max_length)


def micro_batch_rows(tokens: MiniBatchTokens, cfg: AlgorithmConfig, scale: float) -> CreditRows:
    """A micro-batch's rows of the mini-batch's plan, from its own tokens alone, where
    plans_per_micro_batch(cfg) holds; `scale` is length_scale's."""
    valid = tokens.mask > 0
    token_adv, _ = _corrected_advantages(tokens, cfg)
    coef = (_row_weight(cfg.aggregation, valid) * scale).to(tokens.old_logp.dtype)
    return CreditRows(token_adv, [valid * coef])


def _stapo_tau_p(
    p: Tensor,
    advantages: Tensor,
    valid: Tensor,
    cfg: AlgorithmConfig,
    reducer: Reducer,
    auto: RunningProbabilityThreshold | None,
) -> float:
    """STAPO's threshold: the configured one, or with `tau_p: auto` the one that puts
    `stapo.target_share` of the running distribution of the probabilities STAPO examines
    (valid tokens of positive-advantage responses) below it."""
    if cfg.stapo.tau_p != "auto":
        return cfg.stapo.tau_p
    if auto is None:
        raise ValueError("stapo.tau_p is 'auto' but the learner keeps no running threshold")
    examined = valid & (advantages.unsqueeze(-1) > 0)
    return auto.update(reducer.sum(probability_histogram(p[examined])))


def plan_credit(
    tokens: MiniBatchTokens,
    cfg: AlgorithmConfig,
    reducer: Reducer,
    auto_tau_p: RunningProbabilityThreshold | None = None,
) -> CreditPlan:
    """The credit plan of one rank's share of a mini-batch (see the module docstring).
    `auto_tau_p` is the rank's running threshold, needed with `stapo.tau_p: auto`.

    Collectives, in order: with `stapo.tau_p: auto` a sum of the probability histogram, a
    gather of STAPO candidate entropies (always, for spurious_frac),
    a gather of valid-token entropies (20-Entropy only), one sum of a small vector, and a
    max of the response length (`constant` aggregation only).
    """
    valid = tokens.mask > 0
    token_adv, correction = _corrected_advantages(tokens, cfg)

    stapo_p, stapo_entropy = _stapo_source(tokens, cfg, valid)
    tau_p = _stapo_tau_p(stapo_p, tokens.advantages, valid, cfg, reducer, auto_tau_p)
    spurious = stapo_mask(
        stapo_p,
        stapo_entropy,
        tokens.advantages,
        tokens.mask,
        tau_p,
        cfg.stapo.quantile,
        reducer,
    )
    silenced = spurious if cfg.stapo.enabled else torch.zeros_like(spurious)
    unmasked = valid & ~silenced  # what token_mean counts: STAPO renormalises
    trained = unmasked
    if cfg.entropy_mask.enabled:  # 20-Entropy keeps the full count in the denominator
        trained = trained & entropy_top_mask(
            tokens.cur_entropy, tokens.mask, cfg.entropy_mask.rho, reducer
        )
    pass_masks = [tokens_of_pass & trained for tokens_of_pass in _pass_masks(tokens, cfg, valid)]
    row_weight = _row_weight(cfg.aggregation, unmasked)

    p_cur = _probs(tokens.cur_logp, valid)
    lowprob = valid & (p_cur < cfg.lowprob_eta)
    # The logit-gradient norm of each token's term in the update: |c_it A_it| ||d logp / d z||;
    # the global part of c_it is the same for every token, so it cancels in the share.
    logit_norm = logit_grad_norm_sq(p_cur, tokens.cur_sum_p2).to(torch.float64).clamp(min=0).sqrt()
    grad_norm = row_weight * token_adv.abs().to(torch.float64) * logit_norm
    grad_norm = torch.where(trained, grad_norm, torch.zeros_like(grad_norm))  # padding may be NaN
    totals = _sum_over_ranks(
        reducer,
        {
            "valid_tokens": valid.sum(),
            "sequences": valid.any(-1).sum(),
            "unmasked_tokens": unmasked.sum(),
            "trained_tokens": trained.sum(),
            "spurious_tokens": spurious.sum(),
            "silenced_tokens": silenced.sum(),
            "lowprob_tokens": lowprob.sum(),
            "lowprob_grad_norm": grad_norm[lowprob].sum(),
            "grad_norm": grad_norm.sum(),
            **{f"pass{k}_tokens": mask.sum() for k, mask in enumerate(pass_masks)},
        },
    )
    max_length = _max_length(reducer, valid.sum(-1)) if cfg.aggregation == "constant" else 0.0

    coef = (row_weight * _global_scale(cfg.aggregation, totals, max_length)).to(
        tokens.old_logp.dtype
    )
    passes = [mask * coef for k, mask in enumerate(pass_masks) if totals[f"pass{k}_tokens"] > 0]
    valid_tokens = totals["valid_tokens"]
    stats = CreditStats(
        valid_tokens=valid_tokens,
        num_sequences=totals["sequences"],
        trained_frac=_fraction(totals["trained_tokens"], valid_tokens),
        spurious_frac=_fraction(totals["spurious_tokens"], valid_tokens),
        stapo_tau_p=tau_p,
        stapo_silenced_frac=_fraction(totals["silenced_tokens"], valid_tokens),
        lowprob_frac=_fraction(totals["lowprob_tokens"], valid_tokens),
        lowprob_grad_share=_fraction(totals["lowprob_grad_norm"], totals["grad_norm"]),
        optimizer_passes=float(max(len(passes), 1)),
    )
    # At least one pass, so the learner's loop never has to special-case an empty plan.
    return CreditPlan(
        token_adv, passes or [torch.zeros_like(tokens.old_logp)], stats, correction.figures
    )
