"""STAPO's `tau_p: auto`: the probability threshold read from the running distribution of
token probabilities, so that a target share of the tokens STAPO looks at falls below it.

The distribution is a histogram of log10 p over fixed bins, so every rank adds its tokens
into the same few hundred counts and one all-reduce of that vector makes it global, whatever
the number of tokens (no gather of per-token values). Each mini-batch decays the running
counts by `decay` and adds its own, so the threshold follows the policy as it sharpens or
flattens, and the first mini-batch already has one. The threshold is the lower edge of the
bin where the cumulative share reaches the target, so less than the target share lies below
it and at most one bin (a factor of 10**0.05, 12%) separates it from the exact quantile.
The lower edge, not the upper: a peaked policy has most of its tokens in the top bin
[0.89, 1], and an upper edge there would make every token a candidate.

The running counts are part of a learner checkpoint (`state_dict`, learner/checkpoint.py), so
a resumed run, or a learner rebuilt after a failure, goes on with the threshold it had.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOG10_P_MIN = -20.0  # probabilities below 1e-20 count in the lowest bin
BINS_PER_DECADE = 20
NUM_BINS = int(-LOG10_P_MIN * BINS_PER_DECADE)


def probability_histogram(p: Tensor) -> Tensor:
    """Counts (float64, NUM_BINS) of the probabilities `p` (any shape) by log10 p."""
    log10 = p.detach().to(torch.float64).clamp(min=10**LOG10_P_MIN, max=1.0).log10()
    index = ((log10 - LOG10_P_MIN) * BINS_PER_DECADE).floor().long().clamp(0, NUM_BINS - 1)
    return torch.bincount(index.flatten(), minlength=NUM_BINS).to(torch.float64)


def lower_edge(bin_index: int) -> float:
    return 10 ** (LOG10_P_MIN + bin_index / BINS_PER_DECADE)


class RunningProbabilityThreshold:
    """The running histogram of one rank's learner; every rank holds the same one, since each
    adds the same global counts."""

    def __init__(self, target_share: float, decay: float):
        if not 0.0 < target_share < 1.0:
            raise ValueError(f"stapo.target_share must be in (0, 1) (got {target_share!r})")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"stapo.auto_decay must be in [0, 1) (got {decay!r})")
        self.target_share = target_share
        self.decay = decay
        self.counts = torch.zeros(NUM_BINS, dtype=torch.float64)

    def update(self, global_counts: Tensor) -> float:
        """Add a mini-batch's global histogram; the threshold for that mini-batch. With no
        token seen yet it is 0 (nothing below it)."""
        self.counts = self.decay * self.counts + global_counts.to(self.counts)
        return self.threshold()

    def state_dict(self) -> dict[str, Tensor]:
        """The running counts with the binning they were counted in (the settings, target
        share and decay, come from the config of the run that loads them)."""
        binning = torch.tensor([LOG10_P_MIN, BINS_PER_DECADE], dtype=torch.float64)
        return {"counts": self.counts.clone(), "binning": binning}

    def load_state_dict(self, state: dict[str, Tensor]) -> bool:
        """Go on from saved counts; False (nothing loaded) when they were counted in other
        bins than these. Counts that no histogram could hold are ValueError."""
        state = state if isinstance(state, dict) else {}
        counts, binning = state.get("counts"), state.get("binning")
        if not isinstance(counts, Tensor) or not isinstance(binning, Tensor):
            raise ValueError("no running histogram (counts and binning tensors)")
        if binning.tolist() != [LOG10_P_MIN, BINS_PER_DECADE]:
            return False
        if counts.shape != (NUM_BINS,) or counts.dtype != torch.float64:
            raise ValueError(f"counts of shape {tuple(counts.shape)} and {counts.dtype}")
        if not bool(torch.isfinite(counts).all()) or bool((counts < 0).any()):
            raise ValueError("counts that are negative or not finite")
        self.counts = counts.clone()
        return True

    def threshold(self) -> float:
        total = float(self.counts.sum())
        if total <= 0:
            return 0.0
        cumulative = torch.cumsum(self.counts, 0) / total
        # the first bin whose cumulative share reaches the target (a rounding margin so that
        # a share hit exactly by whole bins is not pushed one bin up)
        reached = cumulative >= self.target_share * (1 - 1e-12)
        index = int(torch.nonzero(reached)[0]) if bool(reached.any()) else NUM_BINS - 1
        return lower_edge(index)
