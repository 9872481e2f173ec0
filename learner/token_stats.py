"""Per-token quantities from logits, chunked over tokens so that no more than one chunk's
probabilities exist at a time (the vocabulary can be 150k wide)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenStats:
    logp: torch.Tensor  # [N] log-prob of the target token at temperature T (keeps gradient)
    entropy: torch.Tensor  # [N] entropy of the tempered distribution (detached unless asked)
    sum_p2: torch.Tensor  # [N] sum_j p_j^2 (detached), for the logit-gradient norm


def token_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    chunk_size: int = 1024,
    entropy_grad: bool = False,
) -> TokenStats:
    """logits [N, V], targets [N] -> log-prob, entropy and sum of squared probabilities.

    The entropy keeps its gradient only with `entropy_grad` (an entropy bonus needs it)."""
    logps, entropies, sum_p2s = [], [], []
    for start in range(0, logits.shape[0], chunk_size):
        scaled = logits[start : start + chunk_size].float() / temperature
        target = targets[start : start + chunk_size]
        lse = torch.logsumexp(scaled, dim=-1)
        logps.append(scaled.gather(-1, target[:, None]).squeeze(-1) - lse)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            logp_all = scaled - lse[:, None]
            p = logp_all.exp()
            entropies.append(-(p * logp_all).sum(-1))
        sum_p2s.append((p.detach() ** 2).sum(-1))
    if not logps:
        empty = logits.new_zeros(0)
        return TokenStats(empty, empty, empty)
    return TokenStats(torch.cat(logps), torch.cat(entropies), torch.cat(sum_p2s))
