"""Ulysses sequence parallelism (learner.sequence_parallel_size): one micro-batch over a
group of ranks, each holding a contiguous shard of every row's positions.

Every layer but attention works position by position, so it runs on the shard alone. In
attention the ranks exchange heads for positions by all-to-all (Jacobs et al., DeepSpeed
Ulysses, arXiv 2309.14509): each then holds the whole row for heads/SP of the heads, runs
causal attention over it, and a second all-to-all hands every rank back all heads of its own
positions. Packed rows keep their sequences apart: the full row's position ids (gathered
from the shards) restart at 0 where a sequence starts, and attention runs on each sequence
alone. The token head (learner/token_head.py) runs on the shard's response positions only.

The credit plan needs whole sequences (group statistics, the DFPO prefix trie, Lopti's
split...), and its inputs are a few numbers per token: `assemble_stats` gathers them from
the shards, so each rank of the group sees every token's statistics, with the gradient
flowing only through the tokens its own shard computed. Each rank's backward then gives the
gradient of its shard's tokens; ZeRO-3 sums them over all ranks into the full gradient, and
the plan's reductions run over the ranks holding the same shard of different data
(`data_group`), so every sequence counts once in a denominator.

Why not DeepSpeed's ALST wrapper (deepspeed/runtime/sequence_parallel/ulysses_sp.py): its
attention drops the mask and runs causal attention over the whole gathered row, so packed
sequences would see each other (only flash-attention's varlen path on CUDA separates them);
it is built for a fixed number of rows per micro-batch, while ours vary; and it replaces a
core attention (sdpa, flash) for every model of the process, with groups it builds itself,
where ours come from the learner's layout (docs/long_sequences.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from groupflow.config.base import ConfigError
from groupflow.learner.token_head import ResponsePositions
from groupflow.learner.token_stats import TokenStats


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place in its sequence-parallel group."""

    group: dist.ProcessGroup  # the ranks that share each sequence of a micro-batch
    size: int
    rank: int  # this rank's shard: positions [rank * width / size, (rank + 1) * width / size)


@dataclass(frozen=True)
class ParallelGroups:
    sequence: SequenceParallel | None  # None with sequence_parallel_size 1
    data_group: dist.ProcessGroup | None  # ranks of the same shard of different data; None: all
    data_size: int


def parallel_groups(world_size: int, rank: int, sp_size: int) -> ParallelGroups:
    """Sequence-parallel groups of consecutive ranks, data parallel across them (the ranks
    of one group get the same micro-batches). Collective: every rank creates every group."""
    if sp_size == 1:
        return ParallelGroups(None, None, world_size)
    if world_size % sp_size:
        raise ConfigError(
            f"learner.sequence_parallel_size={sp_size} does not divide learner.num_ranks={world_size}"
        )
    sequence = data = None
    for first in range(0, world_size, sp_size):
        group = dist.new_group(list(range(first, first + sp_size)))
        if first <= rank < first + sp_size:
            sequence = SequenceParallel(group, sp_size, rank - first)
    for shard in range(sp_size):
        group = dist.new_group(list(range(shard, world_size, sp_size)))
        if rank % sp_size == shard:
            data = group
    return ParallelGroups(sequence, data, world_size // sp_size)


def check_heads(heads: int, sp_size: int, model: str = "the model") -> None:
    """Refuse a size that does not divide the model's attention heads (each rank of a group
    attends with heads / size of them)."""
    if heads % sp_size:
        raise ConfigError(
            f"learner.sequence_parallel_size={sp_size} does not divide the "
            f"{heads} attention heads of {model}"
        )


def install_ulysses(model: torch.nn.Module, sp: SequenceParallel) -> None:
    """Make `model`'s attention Ulysses attention over `sp`'s group (before its forwards).
    transformers builds no mask for an attention it does not know: none is needed."""
    from transformers import AttentionInterface

    check_heads(model.config.get_text_config().num_attention_heads, sp.size)
    name = f"groupflow_ulysses_{sp.group.group_name}"

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        return ulysses_attention(module, query, key, value, kw["position_ids"], sp, scaling)

    AttentionInterface.register(name, attention)
    model.set_attn_implementation(name)


class _AllToAll(torch.autograd.Function):
    """Chunk i of dim 0 goes to rank i of the group; its gradient goes back the same way."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_to_all(grad, ctx.group), None


def _all_to_all(x: Tensor, group) -> Tensor:
    x = x.contiguous()  # first: empty_like keeps a view's strides, and the exchange has none
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _positions_to_heads(x: Tensor, sp: SequenceParallel) -> Tensor:
    """(B, H, L/P, D), all heads of this shard -> (B, H/P, L, D), this rank's heads of the row."""
    b, h, local, d = x.shape
    chunks = x.reshape(b, sp.size, h // sp.size, local, d).permute(1, 0, 2, 3, 4)
    out = _AllToAll.apply(chunks, sp.group)  # [p]: shard p's positions of this rank's heads
    return out.permute(1, 2, 0, 3, 4).reshape(b, h // sp.size, sp.size * local, d)


def _heads_to_positions(x: Tensor, sp: SequenceParallel) -> Tensor:
    """The inverse of _positions_to_heads."""
    b, h, length, d = x.shape
    local = length // sp.size
    chunks = x.reshape(b, h, sp.size, local, d).permute(2, 0, 1, 3, 4)
    out = _AllToAll.apply(chunks, sp.group)  # [p]: head group p of this shard's positions
    return out.permute(1, 0, 2, 3, 4).reshape(b, h * sp.size, local, d)


def _gather_columns(t: Tensor, sp: SequenceParallel) -> Tensor:
    parts = [torch.empty_like(t) for _ in range(sp.size)]
    dist.all_gather(parts, t.contiguous(), group=sp.group)
    return torch.cat(parts, dim=1)


def ulysses_attention(
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    position_ids: Tensor,
    sp: SequenceParallel,
    scaling: float | None,
) -> tuple[Tensor, None]:
    """transformers' attention interface on a shard: query (B, H, L/P, D), key and value
    (B, KV, L/P, D), position_ids (B, L/P) -> (B, L/P, H, D)."""
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads % sp.size:  # too few key-value heads to split: each query head gets its own
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    q, k, v = (_positions_to_heads(t, sp) for t in (query, key, value))
    repeat = q.shape[1] // k.shape[1]  # grouped-query attention within this rank's heads
    positions = _gather_columns(position_ids, sp)
    dropout = getattr(module, "attention_dropout", 0.0) if module.training else 0.0
    rows = []
    for row in range(q.shape[0]):
        # A sequence starts where the position ids restart at 0 (padding counts as its own).
        starts = torch.nonzero(positions[row] == 0).flatten().tolist()
        bounds = [*starts, q.shape[2]] if starts and starts[0] == 0 else [0, *starts, q.shape[2]]
        parts = []
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            kk = k[row : row + 1, :, start:end].repeat_interleave(repeat, dim=1)
            vv = v[row : row + 1, :, start:end].repeat_interleave(repeat, dim=1)
            parts.append(
                F.scaled_dot_product_attention(
                    q[row : row + 1, :, start:end],
                    kk,
                    vv,
                    dropout_p=dropout,
                    is_causal=True,
                    scale=scaling,
                )
            )
        rows.append(torch.cat(parts, dim=2))
    out = _heads_to_positions(torch.cat(rows), sp)
    return out.transpose(1, 2).contiguous(), None


# ----- the micro-batch's inputs and statistics, shard by shard ---------------------------------


@dataclass
class Shard:
    """One rank's shard of a micro-batch, and what it takes to put the statistics together."""

    input_ids: Tensor  # (R, W/P)
    position_ids: Tensor  # (R, W/P)
    positions: ResponsePositions  # this shard's response positions, columns within the shard
    shard_of: Tensor  # (N,) the shard of each response position of the micro-batch
    sizes: list[int]  # response tokens of each sequence (the whole micro-batch's)
    first: int = 0  # the shard's first column


def shard_inputs(
    input_ids: Tensor, position_ids: Tensor, positions: ResponsePositions, sp: SequenceParallel
) -> Shard:
    """input_ids and position_ids (R, W) with W a multiple of sp.size: this rank's columns."""
    width = input_ids.shape[1] // sp.size
    first = sp.rank * width
    shard_of = torch.div(positions.cols, width, rounding_mode="floor")
    mine = shard_of == sp.rank
    local = ResponsePositions(
        positions.rows[mine], positions.cols[mine] - first, positions.targets[mine], []
    )
    return Shard(
        input_ids[:, first : first + width],
        position_ids[:, first : first + width],
        local,
        shard_of,
        positions.sizes,
        first,
    )


def assemble_stats(local: TokenStats, shard: Shard, sp: SequenceParallel) -> list[TokenStats]:
    """Every sequence's statistics, whole, from each shard's: the other shards' values
    gathered (no gradient), this shard's the very tensors it computed (with theirs)."""
    counts = torch.bincount(shard.shard_of, minlength=sp.size).tolist()
    mine = torch.stack([local.logp, local.entropy, local.sum_p2])
    padded = F.pad(mine.detach(), (0, max(counts) - mine.shape[1]))
    parts = [torch.empty_like(padded) for _ in range(sp.size)]
    dist.all_gather(parts, padded, group=sp.group)
    pieces = [p[:, :n] for p, n in zip(parts, counts, strict=True)]
    pieces[sp.rank] = mine
    by_shard = torch.cat(pieces, dim=1)  # the positions ordered by shard, each shard in order
    order = torch.argsort(shard.shard_of, stable=True)
    whole = by_shard[:, torch.argsort(order)]
    logp, entropy, sum_p2 = whole
    return TokenStats(logp, entropy, sum_p2).split(shard.sizes)
