"""The forward and the loss of one micro-batch on one rank.

`forward_micro_batch` is the one place that runs the policy on token ids: model -> the
statistics of the response positions. `micro_batch_loss` turns them, with the proximal
statistics and the micro-batch's rows of the credit plan, into the loss to backpropagate and
the micro-batch's figures. Neither knows about DeepSpeed: any Hugging Face causal LM with
the token head installed (learner/model_setup.py) works, a float64 torch model in the tests
included.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from groupflow.config.algorithm import AlgorithmConfig
from groupflow.core.device import to_device
from groupflow.core.records import TrainSequence
from groupflow.learner.batching import pack_rows
from groupflow.learner.credit import CreditRows
from groupflow.learner.figures import UpdateFigures
from groupflow.learner.losses import kl_k2, token_loss
from groupflow.learner.moe_aux import MoeRouting, RoutedTokens, response_index
from groupflow.learner.routing_replay import RoutingGrid, routing_grid, routing_state
from groupflow.learner.sequence_parallel import SequenceParallel, assemble_stats, shard_inputs
from groupflow.learner.token_head import ResponsePositions, response_positions
from groupflow.learner.token_head import response_token_stats as head_token_stats
from groupflow.learner.token_stats import TokenStats, loss_masks


@dataclass
class MicroBatchForward:
    """A micro-batch's forward, as its loss needs it."""

    stats: list[TokenStats]  # one per sequence, response tokens only; with the graph under grad
    # Only for a micro-batch without sequences: 0, with a graph through every parameter.
    empty_loss: Tensor | None = None
    # One per sequence, like stats: 1.0 on model tokens, 0.0 on observations (loss_masks)
    masks: list[Tensor] = field(default_factory=list)
    # A mixture of experts' routing at the trained positions, when the forward recorded it
    routed: RoutedTokens | None = None


@dataclass
class MicroBatchLoss:
    loss: Tensor  # scalar, to backpropagate
    figure_sums: Tensor  # UpdateFigures' sums, on the device (UpdateFigures.of_sums)
    token_grads: list[Tensor]  # per sequence (n_i,) float64 dLoss/dlogp, on the device; or []


@dataclass
class ModelInputs:
    input_ids: Tensor  # (R, W)
    attention_mask: Tensor | None  # (R, W) padded; None packed
    position_ids: Tensor | None  # (R, W) packed; None padded
    positions: ResponsePositions  # where the response tokens are predicted
    all_position_ids: Tensor  # (R, W) packed or not: what a sequence-parallel forward takes
    routing: RoutingGrid | None = None  # the engine's experts per token (learner/routing_replay.py)


def model_inputs(
    seqs: list[TrainSequence], device: torch.device, packed: bool, width_multiple: int = 1
) -> ModelInputs:
    """The model's inputs for `seqs` and the response positions in them. Packed: several
    sequences to a row, each kept to itself by its position_ids restarting at 0 (transformers'
    packed-sequence attention: varlen flash attention on GPUs, a block-causal mask otherwise);
    no attention mask. Padded: a sequence per row, right-padded, with an attention mask.
    Rows are padded to a multiple of `width_multiple` (a sequence-parallel forward's shards)."""
    lengths = [len(s.input_ids) for s in seqs]
    if packed:
        rows, starts, num_rows = pack_rows(lengths)
    else:
        rows, starts, num_rows = list(range(len(seqs))), [0] * len(seqs), len(seqs)
    width = -(-max(lengths) // width_multiple) * width_multiple
    ids = torch.zeros(num_rows, width, dtype=torch.long)
    position_ids = torch.zeros(num_rows, width, dtype=torch.long)
    attention = torch.zeros(num_rows, width, dtype=torch.long)
    row_end = [0] * num_rows
    for seq, row, start in zip(seqs, rows, starts, strict=True):
        end = start + len(seq.input_ids)
        ids[row, start:end] = torch.tensor(seq.input_ids)
        attention[row, start:end] = 1
        position_ids[row, start:end] = torch.arange(end - start)
        row_end[row] = max(row_end[row], end)
    for row, end in enumerate(row_end):
        # A row's padding counts from 0 as a sequence of its own: it never joins a real one.
        position_ids[row, end:] = torch.arange(width - end)
    ids, position_ids = to_device(ids, device), to_device(position_ids, device)
    positions = response_positions(ids, lengths, [s.prompt_len for s in seqs], rows, starts)
    routing = routing_grid([s.routed_experts for s in seqs], rows, starts, width, num_rows)
    if routing is not None:
        routing = RoutingGrid(to_device(routing.experts, device), to_device(routing.known, device))
    if packed:
        return ModelInputs(ids, None, position_ids, positions, position_ids, routing)
    return ModelInputs(ids, to_device(attention, device), None, positions, position_ids, routing)


def response_token_stats(
    model,
    seqs: list[TrainSequence],
    temperature: float,
    device: torch.device,
    entropy_grad: bool,
    packed: bool = True,
    sp: SequenceParallel | None = None,
) -> list[TokenStats]:
    """The statistics of each sequence's response tokens under `model` (one TokenStats each),
    through its token head (learner/token_head.py): no logits of the whole micro-batch exist.
    With `sp`, this rank computes its shard of every row, and every token's statistics are
    put together from the shards (learner/sequence_parallel.py); padded or packed, the shards
    take position ids, not a mask (a right-padded row's padding never precedes a real token).

    Gradient mode is the caller's; the entropy keeps its gradient only with `entropy_grad`."""
    if sp is not None:
        x = model_inputs(seqs, device, packed, width_multiple=sp.size)
        shard = shard_inputs(x.input_ids, x.all_position_ids, x.positions, sp)
        if (routers := routing_state(model)) is not None:
            routers.set(
                None
                if x.routing is None
                else x.routing.columns(shard.first, shard.input_ids.shape[1])
            )
        local = head_token_stats(
            model,
            shard.input_ids,
            None,
            shard.positions,
            temperature,
            entropy_grad,
            shard.position_ids,
        )
        return assemble_stats(local, shard, sp)
    return _stats_of_inputs(model, model_inputs(seqs, device, packed), temperature, entropy_grad)


def _stats_of_inputs(
    model, x: ModelInputs, temperature: float, entropy_grad: bool
) -> list[TokenStats]:
    routers = routing_state(model)
    if routers is not None:
        routers.set(x.routing)
    stats = head_token_stats(
        model, x.input_ids, x.attention_mask, x.positions, temperature, entropy_grad, x.position_ids
    )
    return stats.split(x.positions.sizes)


def empty_micro_batch(model, device: torch.device, sp: SequenceParallel | None = None) -> Tensor:
    """The forward of a micro-batch without sequences: a zero loss over one token (a token
    per shard with `sp`: the group's ranks exchange in attention as for any micro-batch).

    ZeRO-3 gathers every parameter collectively in forward and again in backward, so a rank
    with less work than the others still runs each micro-batch and backpropagates this; the
    token head gives every parameter, its own included, a zero gradient for no positions."""
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    routers = routing_state(model)
    if routers is not None:
        routers.set(None)
    no_positions = response_positions(ids, [], [])
    if sp is None:
        stats = head_token_stats(model, ids, torch.ones_like(ids), no_positions, 1.0)
    else:
        stats = head_token_stats(model, ids, None, no_positions, 1.0, False, torch.zeros_like(ids))
    return stats.logp.sum() * 0.0


def forward_micro_batch(
    model,
    seqs: list[TrainSequence],
    temperature: float,
    device: torch.device,
    entropy_grad: bool,
    packed: bool = True,
    sp: SequenceParallel | None = None,
    routing: MoeRouting | None = None,
) -> MicroBatchForward:
    """With `routing` (a mixture of experts' routers; not with `sp`, whose ranks each see a
    shard of the positions), the routing of the trained positions comes along."""
    if not seqs:
        return MicroBatchForward([], empty_loss=empty_micro_batch(model, device, sp))
    if routing is None or sp is not None:
        stats = response_token_stats(model, seqs, temperature, device, entropy_grad, packed, sp)
        return MicroBatchForward(stats, masks=loss_masks(seqs, [s.logp for s in stats]))
    x = model_inputs(seqs, device, packed)
    with routing.recording() as logits:
        stats = _stats_of_inputs(model, x, temperature, entropy_grad)
    masks = loss_masks(seqs, [s.logp for s in stats])
    index = response_index(x.positions, x.input_ids.shape[1])
    routed = routing.at_positions(logits, index, torch.cat(masks))
    return MicroBatchForward(stats, masks=masks, routed=routed)


def check_packing(
    model, vocab_size: int, device: torch.device, sp: SequenceParallel | None = None
) -> None:
    """Raise unless `model` keeps packed sequences apart. Packing relies on the model's
    attention taking a sequence's restart of position_ids at 0 as its start (transformers'
    packed-sequence support); an attention that ignores it lets a sequence see the one before
    it in its row, silently. So: the same sequence, packed behind two different ones, must
    get the same log-probs. Every rank calls it (ZeRO-3's forwards are collective)."""
    probe = [(7 * i + 3) % vocab_size for i in range(6)]
    longest = [(3 * i + 1) % vocab_size for i in range(18)]  # a row of its own: width 18
    logps = []
    for shift in (1, 2):
        before = [(5 * i + shift) % vocab_size for i in range(12)]  # the probe's row-mate
        seqs = [TrainSequence(s, 2, 0.0, g, 0, []) for g, s in enumerate((longest, before, probe))]
        with torch.no_grad():
            logps.append(response_token_stats(model, seqs, 1.0, device, False, True, sp)[2].logp)
    if not torch.allclose(logps[0], logps[1], rtol=1e-5, atol=1e-5):
        raise ValueError(
            "learner.pack_sequences: this model's attention lets packed sequences see each "
            "other (it ignores position_ids restarting at 0); set learner.pack_sequences=false"
        )


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
        no_figures = UpdateFigures.zero_sums(forward.empty_loss.device)
        return MicroBatchLoss(forward.empty_loss, no_figures, [])
    logp = _pad([s.logp for s in forward.stats])  # (B, T)
    old_logp = _pad([s.logp for s in old])
    mask = _pad(forward.masks)
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
        grad = grad.detach().to(torch.float64)
        grads = [grad[row, : len(s.logp)] for row, s in enumerate(forward.stats)]
    # Sums of masked tensors, left on the device: the step reads them once (UpdateFigures).
    valid = mask > 0
    terms = [
        valid.sum(),
        (out.clipped_low & valid).sum(),
        (out.clipped_high & valid).sum(),
        torch.where(valid, kl_k2(logp.detach(), old_logp), 0.0).sum(),  # KL(old || current)
        torch.where(valid, out.kl, 0.0).sum(),
    ]
    return MicroBatchLoss(loss, torch.stack([t.to(torch.float64) for t in terms]), grads)
