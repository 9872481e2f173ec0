"""The forward and the loss of one micro-batch on one rank.

`forward_micro_batch` is the one place that runs the policy on token ids: model -> the
statistics of the response positions. `micro_batch_loss` turns them, with the behaviour
statistics and the micro-batch's rows of the credit plan, into the loss to backpropagate and
the micro-batch's figures. Neither knows about DeepSpeed: any Hugging Face causal LM with
the token head installed (learner/model_setup.py) works, a float64 torch model in the tests
included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from groupflow.config import AlgorithmConfig
from groupflow.learner.credit import CreditRows
from groupflow.learner.figures import UpdateFigures
from groupflow.learner.losses import kl_k2, token_loss
from groupflow.learner.token_head import response_positions
from groupflow.learner.token_head import response_token_stats as head_token_stats
from groupflow.learner.token_stats import TokenStats
from groupflow.records import TrainSequence


@dataclass
class MicroBatchForward:
    """A micro-batch's forward, as its loss needs it."""

    stats: list[TokenStats]  # one per sequence, response tokens only; with the graph under grad
    # Only for a micro-batch without sequences: 0, with a graph through every parameter.
    empty_loss: Tensor | None = None


@dataclass
class MicroBatchLoss:
    loss: Tensor  # scalar, to backpropagate
    figures: UpdateFigures
    token_grads: list[Tensor]  # per sequence (n_i,) float64 dLoss/dlogp; empty unless asked


def _padded_ids(seqs: list[TrainSequence], device: torch.device) -> tuple[Tensor, Tensor]:
    """(B, W) input ids and attention mask, right-padded."""
    width = max(len(s.input_ids) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attention = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq.input_ids)] = torch.tensor(seq.input_ids)
        attention[row, : len(seq.input_ids)] = 1
    return ids.to(device), attention.to(device)


def response_token_stats(
    model, seqs: list[TrainSequence], temperature: float, device: torch.device, entropy_grad: bool
) -> list[TokenStats]:
    """The statistics of each sequence's response tokens under `model` (one TokenStats each),
    through its token head (learner/token_head.py): no logits of the whole micro-batch exist.

    Gradient mode is the caller's; the entropy keeps its gradient only with `entropy_grad`."""
    ids, attention = _padded_ids(seqs, device)
    positions = response_positions(
        ids, [len(s.input_ids) for s in seqs], [s.prompt_len for s in seqs]
    )
    stats = head_token_stats(model, ids, attention, positions, temperature, entropy_grad)
    return stats.split(positions.sizes)


def empty_micro_batch(model, device: torch.device) -> Tensor:
    """The forward of a micro-batch without sequences: a zero loss over one token.

    ZeRO-3 gathers every parameter collectively in forward and again in backward, so a rank
    with less work than the others still runs each micro-batch and backpropagates this; the
    token head gives every parameter, its own included, a zero gradient for no positions."""
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    no_positions = response_positions(ids, [], [])
    stats = head_token_stats(model, ids, torch.ones_like(ids), no_positions, 1.0)
    return stats.logp.sum() * 0.0


def forward_micro_batch(
    model, seqs: list[TrainSequence], temperature: float, device: torch.device, entropy_grad: bool
) -> MicroBatchForward:
    if not seqs:
        return MicroBatchForward([], empty_loss=empty_micro_batch(model, device))
    return MicroBatchForward(response_token_stats(model, seqs, temperature, device, entropy_grad))


def _pad(rows: list[Tensor]) -> Tensor:
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)


def micro_batch_loss(
    forward: MicroBatchForward,
    old: list[TokenStats],
    ref_logp: list[Tensor] | None,
    plan: CreditRows,
    pass_index: int,
    cfg: AlgorithmConfig,
    token_grads: bool,
) -> MicroBatchLoss:
    """The loss of one optimizer pass over one micro-batch: sum of c_it l_it over its tokens.

    old and ref_logp hold one entry per sequence, as forward.stats does; `plan` holds the
    micro-batch's rows of the mini-batch's credit plan (CreditPlan.split, or micro_batch_rows). With `token_grads`,
    dLoss/dlogp per token comes back for the cancellation residual (a backward through the
    token loss only, not the model)."""
    if forward.empty_loss is not None:
        return MicroBatchLoss(forward.empty_loss, UpdateFigures(), [])
    logp = _pad([s.logp for s in forward.stats])  # (B, T)
    old_logp = _pad([s.logp for s in old])
    mask = _pad([torch.ones_like(s.logp) for s in forward.stats])
    width = logp.shape[1]
    out = token_loss(
        logp,
        old_logp,
        plan.token_adv[:, :width],
        mask,
        cfg,
        ref_logp=None if ref_logp is None else _pad(ref_logp),
        entropy=_pad([s.entropy for s in forward.stats]) if cfg.entropy_coef != 0 else None,
    )
    loss = (plan.passes[pass_index][:, :width] * out.loss).sum()
    grads: list[Tensor] = []
    if token_grads:
        (grad,) = torch.autograd.grad(loss, logp, retain_graph=True)
        grad = grad.detach().to("cpu", torch.float64)
        grads = [grad[row, : len(s.logp)] for row, s in enumerate(forward.stats)]
    valid = mask > 0
    terms = [
        valid.sum(),
        out.clipped_low[valid].sum(),
        out.clipped_high[valid].sum(),
        kl_k2(logp.detach(), old_logp)[valid].sum(),  # KL(old || current), before the update
        out.kl[valid].sum(),
    ]
    sums = torch.stack([t.to(torch.float64) for t in terms]).tolist()  # one device sync
    figures = UpdateFigures(
        tokens=int(sums[0]),
        clipped_low=int(sums[1]),
        clipped_high=int(sums[2]),
        approx_kl=sums[3],
        kl_ref=sums[4],
    )
    return MicroBatchLoss(loss, figures, grads)
