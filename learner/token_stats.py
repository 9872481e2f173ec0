"""Per-token quantities of the tempered next-token distribution.

`TokenStats` is what the learner keeps per response token. `token_stats` computes it from
full logits (the reference path; learner/token_head.py computes the same from hidden states
without ever holding a whole micro-batch's logits)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupflow.core.device import to_device
from groupflow.core.records import TrainSequence


@dataclass
class TokenStats:
    logp: torch.Tensor  # (N,) log-prob of the target token at temperature T (keeps gradient)
    entropy: torch.Tensor  # (N,) entropy of the tempered distribution (detached unless asked)
    sum_p2: torch.Tensor  # (N,) sum_j p_j^2 (detached), for the logit-gradient norm

    def split(self, sizes: list[int]) -> list[TokenStats]:
        """One TokenStats per sequence, `sizes` tokens each, in order."""
        parts = zip(
            self.logp.split(sizes), self.entropy.split(sizes), self.sum_p2.split(sizes), strict=True
        )
        return [TokenStats(*p) for p in parts]


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics are taken in at least float32 (bf16 logits lose the tail of the softmax)."""
    return torch.promote_types(dtype, torch.float32)


def token_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    chunk_size: int = 1024,
    entropy_grad: bool = False,
) -> TokenStats:
    """logits (N, V), targets (N,) -> log-prob, entropy and sum of squared probabilities,
    the softmax taken `chunk_size` tokens at a time.

    The entropy keeps its gradient only with `entropy_grad` (an entropy bonus needs it)."""
    logps, entropies, sum_p2s = [], [], []
    for start in range(0, logits.shape[0], chunk_size):
        chunk = logits[start : start + chunk_size]
        scaled = chunk.to(stats_dtype(chunk.dtype)) / temperature
        target = targets[start : start + chunk_size]
        lse = torch.logsumexp(scaled, dim=-1)
        logps.append(scaled.gather(-1, target[:, None]).squeeze(-1) - lse)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            logp_all = scaled - lse[:, None]
            p = logp_all.exp()
            entropies.append(-(p * logp_all).sum(-1))
        sum_p2s.append((p.detach() ** 2).sum(-1))
    if not logps:
        empty = logits.new_zeros(0, dtype=stats_dtype(logits.dtype))
        return TokenStats(empty, empty, empty)
    return TokenStats(torch.cat(logps), torch.cat(entropies), torch.cat(sum_p2s))


def loss_masks(seqs: list[TrainSequence], like: list[Tensor]) -> list[Tensor]:
    """Each sequence's loss mask (TrainSequence.loss_mask) as a tensor like its stats row:
    1.0 on the model's tokens, 0.0 on observations. The credit plan and the loss read every
    token through it, so an observation token weighs nothing anywhere, as padding does."""
    return [
        torch.ones_like(row)
        if s.loss_mask is None
        else to_device(torch.tensor(s.loss_mask, dtype=row.dtype), row.device)
        for s, row in zip(seqs, like, strict=True)
    ]
