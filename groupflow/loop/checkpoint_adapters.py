"""A checkpoint's adapter record against the tensors its learner saved.

A checkpoint's driver state records what its learner trained (`Provenance.adapter`: LoRA's
rank, alpha and targets, or None for the whole model), and a resume compares that record with
the job's config. The record is a JSON file outside the manifest's hashes (the manifest is in
it), so an edited record would pass that comparison and fail inside every rank's load, after
every actor started. Here it is compared with the tensors themselves, before anything starts:
DeepSpeed's model states (`param_shapes`: the name and shape of every trained parameter, as
the ranks' optimizer holds them) and, for adapters, the fp32 partitions the ranks saved, every
value finite.
"""

from __future__ import annotations

from pathlib import Path

import torch

from groupflow.core.adapters import wire_name
from groupflow.core.errors import CheckpointError
from groupflow.core.safe_pickle import restricted_load

MODEL_STATES = "_model_states.pt"  # DeepSpeed's per-rank file of the module and its shapes
OPTIM_STATES = "_optim_states.pt"  # DeepSpeed's per-rank file of the fp32 partitions


def check_adapter_record(
    checkpoint: Path, learner_files: list[str], record: dict | None, record_file: Path
) -> None:
    """CheckpointError naming the file and the culprit where the learner's saved tensors are
    not what `record` (from `record_file`) says: adapters where it says the whole model or the
    reverse, a matrix at another rank, a lora_A without its lora_B, a target the record does not
    name, or NaN or infinite adapter values. `learner_files` are the manifest's names of the
    learner's files, relative to `checkpoint`."""
    states = sorted(name for name in learner_files if name.endswith(MODEL_STATES))
    if not states:
        raise CheckpointError(f"{checkpoint}: no DeepSpeed model states in the learner's files")
    states_file = checkpoint / states[0]
    shapes = _trained_shapes(states_file)
    adapters = {name: shape for name, shape in shapes.items() if wire_name(name) is not None}
    if record is None:
        if adapters:
            first = next(iter(adapters))
            raise CheckpointError(
                f"{record_file}: provenance.adapter is null (the whole model), but {states_file} "
                f"holds LoRA matrices ({first})"
            )
        return
    whole = next((name for name in shapes if name not in adapters), None)
    if whole is not None or not adapters:
        what = f"{whole}, not a LoRA matrix" if whole else "no LoRA matrix"
        raise CheckpointError(
            f"{record_file}: provenance.adapter records LoRA adapters, but {states_file} holds "
            f"{what}"
        )
    _check_matrices(adapters, record, record_file, states_file)
    for name in learner_files:
        if name.endswith(OPTIM_STATES):
            _check_finite(checkpoint / name)


def _trained_shapes(states_file: Path) -> dict[str, tuple[int, ...]]:
    state = restricted_load(states_file, map_location="cpu", mmap=True)
    groups = state.get("param_shapes") if isinstance(state, dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise CheckpointError(f"{states_file}: no param_shapes (not a ZeRO-3 checkpoint)")
    return {str(name): tuple(shape) for group in groups for name, shape in group.items()}


def _check_matrices(
    adapters: dict[str, tuple[int, ...]], record: dict, record_file: Path, states_file: Path
) -> None:
    rank, targets = record.get("rank"), record.get("target_modules")
    halves: dict[str, set[str]] = {}
    for name, shape in adapters.items():
        layer, _, half_name = wire_name(name).rpartition(".lora_")  # "...q_proj", "A.weight"
        half = half_name[0]
        its_rank = shape[0] if half == "A" else shape[-1]
        if len(shape) != 2 or its_rank != rank:
            raise CheckpointError(
                f"{record_file}: provenance.adapter.rank is {rank!r}, but {states_file} holds "
                f"{name} of shape {list(shape)}"
            )
        if isinstance(targets, list) and not any(
            layer == t or layer.endswith(f".{t}") for t in targets
        ):
            raise CheckpointError(
                f"{record_file}: provenance.adapter.target_modules {targets} does not name "
                f"{layer}, which {states_file} holds adapters of"
            )
        halves.setdefault(layer, set()).add(half)
    for layer, found in halves.items():
        if found != {"A", "B"}:
            (lone,) = found
            raise CheckpointError(
                f"{states_file}: {layer}.lora_{lone} has no lora_{'B' if lone == 'A' else 'A'}"
            )


def _check_finite(optim_file: Path) -> None:
    """The rank's fp32 partitions of the adapters (small: the frozen model is not saved)."""
    state = restricted_load(optim_file, map_location="cpu", mmap=True)
    inner = state.get("optimizer_state_dict") if isinstance(state, dict) else None
    groups = inner.get("fp32_flat_groups") if isinstance(inner, dict) else None
    for tensor in groups if isinstance(groups, list) else []:
        if isinstance(tensor, torch.Tensor) and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(
                f"{optim_file}: the adapters' weights hold NaN or infinite values"
            )
