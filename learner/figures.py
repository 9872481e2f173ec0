"""A learner rank's figures of one step, and the step record's learner keys from all ranks.

Everything a rank reports is a sum, a max or a figure that is already global over ranks, so
the driver combines ranks with `RankFigures.merge` and nothing else: no per-token data crosses
the wire.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, fields
from functools import reduce

import torch

from groupflow.core.device import to_device
from groupflow.core.records import TrainSequence
from groupflow.learner.credit import CreditStats
from groupflow.learner.diagnostics import CancellationResidual
from groupflow.learner.moe_aux import MoeFigures
from groupflow.learner.off_policy import OffPolicyFigures
from groupflow.learner.routing_replay import RoutingCounts
from groupflow.learner.token_stats import TokenStats, loss_masks


@dataclass
class ProximalFigures:
    """Sums over a rank's response tokens under the proximal policy (the learner's weights at
    the step's start), once per mini-batch."""

    tokens: int = 0
    entropy: float = 0.0
    tokens_pos: int = 0  # tokens of responses with A > 0
    entropy_pos: float = 0.0
    tokens_neg: int = 0  # tokens of responses with A < 0
    entropy_neg: float = 0.0
    logp_mismatch: float = 0.0  # sum of |logp - vLLM's logp| where vLLM's numbers came along
    logp_mismatch_max: float = 0.0

    @classmethod
    def of(cls, seqs: list[TrainSequence], stats: list[TokenStats]) -> ProximalFigures:
        """The figures of `seqs` under their proximal statistics (one TokenStats each),
        read from the device in one copy."""
        if not seqs:
            return cls()
        masks = loss_masks(seqs, [s.entropy for s in stats])  # observations count nowhere
        entropy = torch.nn.utils.rnn.pad_sequence(
            [s.entropy.detach() * m for s, m in zip(stats, masks, strict=True)], batch_first=True
        )
        per_seq_entropy = entropy.to(torch.float64).sum(-1)  # padding is 0
        mismatch = _vllm_mismatch(seqs, stats, masks)
        host = torch.cat([per_seq_entropy, mismatch]).cpu()
        per_seq_entropy, mismatch = host[: len(seqs)], host[len(seqs) :]
        lengths = torch.tensor([s.num_model_tokens for s in seqs], dtype=torch.float64)
        advantages = torch.tensor([s.advantage for s in seqs], dtype=torch.float64)
        pos, neg = advantages > 0, advantages < 0
        return cls(
            tokens=int(lengths.sum()),
            entropy=per_seq_entropy.sum().item(),
            tokens_pos=int(lengths[pos].sum()),
            entropy_pos=per_seq_entropy[pos].sum().item(),
            tokens_neg=int(lengths[neg].sum()),
            entropy_neg=per_seq_entropy[neg].sum().item(),
            logp_mismatch=mismatch.sum().item(),
            logp_mismatch_max=mismatch.max().item() if mismatch.numel() else 0.0,
        )

    def merge(self, other: ProximalFigures) -> ProximalFigures:
        """Every field adds except the max."""
        merged = _add_fields(self, other)
        merged.logp_mismatch_max = max(self.logp_mismatch_max, other.logp_mismatch_max)
        return merged


def _vllm_mismatch(
    seqs: list[TrainSequence], stats: list[TokenStats], masks: list[torch.Tensor]
) -> torch.Tensor:
    """|learner logp - vLLM logp| of every model token of the sequences that carry vLLM's
    numbers, float64 on the statistics' device."""
    ours, theirs = [], []
    for seq, seq_stats, mask in zip(seqs, stats, masks, strict=True):
        if seq.vllm_logprobs:
            ours.append(seq_stats.logp.detach()[mask > 0])
            theirs.extend(seq.vllm_logprobs)
    if not ours:
        return torch.zeros(0, dtype=torch.float64, device=stats[0].logp.device)
    ours_t = torch.cat(ours).to(torch.float64)
    theirs_t = to_device(torch.tensor(theirs, dtype=torch.float64), ours_t.device)
    return (ours_t - theirs_t).abs()


@dataclass
class UpdateFigures:
    """Sums over the tokens of each micro-batch as it is updated (every optimizer pass counts)."""

    tokens: int = 0
    clipped_low: int = 0
    clipped_high: int = 0
    approx_kl: float = 0.0  # k2 estimate of KL(old || current) per token, summed
    kl_ref: float = 0.0  # the configured estimator against the reference policy, summed

    def merge(self, other: UpdateFigures) -> UpdateFigures:
        return _add_fields(self, other)

    # A micro-batch's figures stay on the device as a float64 vector of these sums, in field
    # order, added up over a mini-batch and read once (reading per micro-batch would stall
    # the host on every one).
    @staticmethod
    def zero_sums(device: torch.device) -> torch.Tensor:
        return torch.zeros(len(fields(UpdateFigures)), dtype=torch.float64, device=device)

    @classmethod
    def of_sums(cls, sums: torch.Tensor) -> UpdateFigures:
        """The figures of a vector of sums (one synchronisation)."""
        tokens, clipped_low, clipped_high, approx_kl, kl_ref = sums.tolist()
        return cls(int(tokens), int(clipped_low), int(clipped_high), approx_kl, kl_ref)


@dataclass
class RankFigures:
    """One rank's figures of one step (or of the mini-batches it has trained so far)."""

    proximal: ProximalFigures = field(default_factory=ProximalFigures)
    update: UpdateFigures = field(default_factory=UpdateFigures)
    residual: CancellationResidual = field(
        default_factory=CancellationResidual
    )  # nodes shared by >= 2
    residual_whole_group: CancellationResidual = field(default_factory=CancellationResidual)
    off_policy: OffPolicyFigures = field(default_factory=OffPolicyFigures)
    moe: MoeFigures = field(default_factory=MoeFigures)  # a mixture of experts' routing
    # Global over ranks, so every rank holds the same values: one per mini-batch, one per update.
    credit: list[CreditStats] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    # The rank's peak memory over the step (resident on a CPU, allocated on a GPU), in bytes
    peak_memory_bytes: int = 0
    memory_limit_bytes: int = 0  # the memory the rank may use (learner.memory_gib)
    # (token, layer) pairs whose experts the engine and the learner chose differently, and
    # all those compared (learner/routing_replay.py); (0, 0) without the engine's routing
    routing: RoutingCounts = field(default_factory=RoutingCounts)

    @property
    def optimizer_updates(self) -> int:
        return len(self.grad_norms)

    def extend(self, later: RankFigures) -> RankFigures:
        """This rank's figures followed by its own figures of later mini-batches."""
        return RankFigures(
            **self._merged_sums(later),
            credit=self.credit + later.credit,
            grad_norms=self.grad_norms + later.grad_norms,
            peak_memory_bytes=max(self.peak_memory_bytes, later.peak_memory_bytes),
            memory_limit_bytes=max(self.memory_limit_bytes, later.memory_limit_bytes),
        )

    def merge(self, other_rank: RankFigures) -> RankFigures:
        """The figures of this rank and another rank of the same step."""
        if len(self.credit) != len(other_rank.credit):
            raise ValueError(
                f"ranks trained {len(self.credit)} and {len(other_rank.credit)} mini-batches"
            )
        return RankFigures(
            **self._merged_sums(other_rank),
            credit=self.credit,
            grad_norms=self.grad_norms,
            peak_memory_bytes=max(self.peak_memory_bytes, other_rank.peak_memory_bytes),
            memory_limit_bytes=min(
                self.memory_limit_bytes or other_rank.memory_limit_bytes,
                other_rank.memory_limit_bytes or self.memory_limit_bytes,
            ),
        )

    def _merged_sums(self, other: RankFigures) -> dict:
        return {
            "proximal": self.proximal.merge(other.proximal),
            "update": self.update.merge(other.update),
            "residual": self.residual.merge(other.residual),
            "residual_whole_group": self.residual_whole_group.merge(other.residual_whole_group),
            "off_policy": self.off_policy.merge(other.off_policy),
            "moe": self.moe.merge(other.moe),
            "routing": _add_fields(self.routing, other.routing),
        }


def _add_fields(a, b):
    return type(a)(**{f.name: getattr(a, f.name) + getattr(b, f.name) for f in fields(a)})


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def _credit_mean(credit: list[CreditStats], name: str) -> float:
    return statistics.fmean(getattr(c, name) for c in credit) if credit else 0.0


def learner_record(results: list[RankFigures]) -> dict[str, float]:
    """The step record's learner keys from every rank's figures of the step."""
    total = reduce(RankFigures.merge, results) if results else RankFigures()
    proximal, update, off_policy = total.proximal, total.update, total.off_policy
    grad_norms = [g for g in total.grad_norms if not math.isnan(g)]
    clip_low = _ratio(update.clipped_low, update.tokens)
    clip_high = _ratio(update.clipped_high, update.tokens)
    record = {
        "entropy_mean": _ratio(proximal.entropy, proximal.tokens),
        "entropy_pos": _ratio(proximal.entropy_pos, proximal.tokens_pos),
        "entropy_neg": _ratio(proximal.entropy_neg, proximal.tokens_neg),
        "clip_frac_low": clip_low,
        "clip_frac_high": clip_high,
        "clip_frac": clip_low + clip_high,
        "approx_kl": _ratio(update.approx_kl, update.tokens),
        "kl_ref": _ratio(update.kl_ref, update.tokens),
        "grad_norm": statistics.fmean(grad_norms) if grad_norms else 0.0,
        "optimizer_updates": total.optimizer_updates,
        "logp_mismatch_mean": _ratio(proximal.logp_mismatch, proximal.tokens),
        "logp_mismatch_max": proximal.logp_mismatch_max,
        "cancellation_residual": total.residual.value,
        # only nodes every response of the group passes through: exactly 0 when the
        # aggregation is exchangeable and nothing clips or masks by sign
        "cancellation_residual_whole_group": total.residual_whole_group.value,
        # the off-policy correction, over the tokens that carry vLLM's log-probs (0 if none)
        "is_weight_mean": _ratio(off_policy.weight, off_policy.tokens),
        "is_weight_max": off_policy.weight_max,
        "is_truncated_frac": _ratio(off_policy.truncated, off_policy.tokens),
        "is_masked_frac": _ratio(off_policy.masked, off_policy.tokens),
        "kl_behaviour_proximal": _ratio(off_policy.kl, off_policy.tokens),
        # the largest rank's, by pool as the series labels it (groupflow_actor_memory_bytes)
        "actor_memory_bytes": {"learner": total.peak_memory_bytes},
        "actor_memory_limit_bytes": {"learner": total.memory_limit_bytes},
    }
    record.update(total.moe.record())  # a mixture of experts' routing (none for a dense model)
    if total.routing.pairs:  # a mixture of experts with the engine's routing
        record["routing_disagreement"] = total.routing.differing / total.routing.pairs
    # The credit figures over the step's mini-batches: token counts add up, shares and
    # thresholds are averaged. The step's sequence count is the rollout's (num_sequences,
    # groupflow/observe/rollout_figures.py), one key from one place.
    for f in fields(CreditStats):
        if f.name in _ADDED_UP:
            record[f.name] = sum(getattr(c, f.name) for c in total.credit)
        elif f.name != "num_sequences":
            record[f.name] = _credit_mean(total.credit, f.name)
    return record


_ADDED_UP = {"valid_tokens"}
