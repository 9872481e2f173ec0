"""How many positions a rank's micro-batch may hold (`learner.micro_batch_tokens: auto`).

A rank's memory is what stays (the process, its parameters, gradients and Adam moments) plus
what a micro-batch brings, which grows with its positions. The budget is the memory the rank
may use (`learner.memory_gib`, by default its share of the node or of its device) less what
stays, over the bytes a position costs: first as the model's config says (its shape, dtype and
activation checkpointing), then as the first step measured (`measured_budget`), which replaces
the estimate for every later step.
"""

from __future__ import annotations

from dataclasses import dataclass

from groupflow.config.base import ConfigError

GIB = 1 << 30
# Freed blocks the allocator keeps, buffers of the collectives, the token head's chunk: what the
# shape alone does not say, as a share of the estimate.
ESTIMATE_MARGIN = 1.5
# On a CPU node the ranks share half of the node's memory: the engines, reward workers, the
# driver and the system keep the other half. A GPU rank may use this share of its device.
CPU_NODE_SHARE = 0.5
GPU_DEVICE_SHARE = 0.9
# Of the memory the first step measured as free, the share later micro-batches may fill.
MEASURED_MARGIN = 0.8
LARGEST_BUDGET = 1 << 22  # positions: beyond this the layout, not memory, bounds a micro-batch


@dataclass(frozen=True)
class ModelShape:
    """What of a Hugging Face config sizes a position's activations."""

    hidden: int
    intermediate: int
    layers: int
    num_parameters: int

    @classmethod
    def of(cls, config, num_parameters: int) -> ModelShape:
        hidden = config.hidden_size
        intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
        return cls(hidden, intermediate, config.num_hidden_layers, num_parameters)


def bytes_per_position(shape: ModelShape, dtype_bytes: int, checkpointing: bool) -> int:
    """Activation bytes one position costs through forward and backward. A transformer layer
    keeps about 10 hidden-sized and 4 intermediate-sized vectors a position (attention's
    projections and output, the norms, the MLP's gate, up, activation and product); with
    checkpointing only each layer's input stays, and one layer's activations are recomputed
    at a time. The token head keeps the hidden state of each response position."""
    layer = 10 * shape.hidden + 4 * shape.intermediate
    kept = shape.layers * shape.hidden + layer if checkpointing else shape.layers * layer
    return int((kept + shape.hidden) * dtype_bytes * ESTIMATE_MARGIN)


def fixed_bytes(shape: ModelShape, dtype_bytes: int, world_size: int, baseline: int) -> int:
    """What stays whatever the micro-batch: the process (`baseline`, resident before the
    model), the model's weights in `dtype_bytes` (ZeRO-3 keeps small models whole on every
    rank: counted whole), and this rank's share of the fp32 master weights, gradients and
    the two Adam moments."""
    n = shape.num_parameters
    return baseline + n * dtype_bytes + n * 16 // max(1, world_size)


def rank_memory_bytes(
    memory_gib: float | None, node_bytes: int, device_bytes: int, ranks: int
) -> int:
    """The memory a rank may use: `memory_gib` when set; else a share of its GPU
    (`device_bytes` > 0), or of its node's memory shared among the node's `ranks`."""
    if memory_gib is not None:
        return int(memory_gib * GIB)
    if device_bytes > 0:
        return int(device_bytes * GPU_DEVICE_SHARE)
    return int(node_bytes * CPU_NODE_SHARE / max(1, ranks))


def estimated_budget(memory: int, fixed: int, per_position: int) -> int:
    """Positions a micro-batch may hold when `fixed` bytes stay and each costs `per_position`
    (0: not even one position fits)."""
    return max(0, min(LARGEST_BUDGET, (memory - fixed) // max(1, per_position)))


def measured_budget(memory: int, resident_before: int, peak: int, positions: int) -> int:
    """The budget after a step that started with `resident_before` bytes and peaked at `peak`
    over micro-batches of at most `positions` positions: the bytes a position cost, measured,
    in place of the estimate."""
    per_position = max(1, (peak - resident_before) // max(1, positions))
    room = int((memory - resident_before) * MEASURED_MARGIN)
    return max(0, min(LARGEST_BUDGET, room // per_position))


def mini_batch_share(
    sequences: int, ranks: int, mini_batches: int, longest: int, sequence_parallel: int
) -> int:
    """The most positions one rank computes for a mini-batch: its data-parallel share of the
    step's `sequences`, each `longest` tokens (a row at its share of a sequence-parallel
    group)."""
    data_parallel = max(1, ranks // sequence_parallel)
    per_rank = -(-sequences // (data_parallel * mini_batches))
    return per_rank * -(-longest // sequence_parallel)


@dataclass(frozen=True)
class CheckpointingChoice:
    """`learner.gradient_checkpointing: auto` decided for a rank, with the figures behind it."""

    on: bool
    share: int  # positions of a rank's share of a mini-batch (mini_batch_share)
    without: int  # positions a micro-batch may hold without checkpointing
    memory: int  # bytes the rank may use

    def line(self) -> str:
        state = "on" if self.on else "off"
        fits = "does not fit" if self.on else "fits"
        return (
            f"gradient checkpointing {state} (auto: a rank's share of a mini-batch, "
            f"{self.share:,} positions, {fits} one micro-batch without it, of up to "
            f"{self.without:,} positions in {self.memory / GIB:.1f} GiB)"
        )


def choose_checkpointing(
    memory: int, fixed: int, shape: ModelShape, dtype_bytes: int, share: int
) -> CheckpointingChoice:
    """Checkpointing pays only where it saves a micro-batch: a rank's whole share that fits
    one micro-batch without it would cost a recomputed forward for nothing (on a CPU about a
    fifth of the learner's time), while a share that does not would be cut into several
    micro-batches, each gathering ZeRO-3's parameters again, or need the memory that
    checkpointing leaves free."""
    without = estimated_budget(memory, fixed, bytes_per_position(shape, dtype_bytes, False))
    return CheckpointingChoice(share > without, share, without, memory)


def check_longest_fits(budget: int, longest: int, memory_gib: float | None) -> None:
    """ConfigError, in one line, when a sequence of `longest` tokens cannot fit a micro-batch
    of `budget` positions, the auto budget in `memory_gib`."""
    if budget >= longest:
        return
    given = f"={memory_gib:g}" if memory_gib is not None else " (unset: the rank's share)"
    raise ConfigError(
        f"learner.micro_batch_tokens: auto fits {budget} positions a micro-batch in "
        f"learner.memory_gib{given}, less than one sequence of up to {longest} tokens "
        "(rollout.max_model_len); raise learner.memory_gib or lower rollout.max_model_len"
    )
