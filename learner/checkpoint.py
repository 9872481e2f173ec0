"""A rank's share of a checkpoint: DeepSpeed's own save and load of the ZeRO-3 model and
optimizer shards (each rank writes and reads only its own partition), plus the rank's RNG and,
with `stapo.tau_p: auto`, its running threshold (learner/auto_threshold.py).

Both are collective: every rank calls them together with the same directory. The directory
is a staging name the driver renames once every rank has returned (groupflow/loop/checkpoint.py).
A load runs no code from the files: DeepSpeed's reads go through the restricted unpickler
(groupflow/core/safe_pickle.py `restricted_load`) instead of its own unrestricted torch.load.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import torch

from groupflow.core.errors import CheckpointError
from groupflow.core.safe_pickle import restricted_load
from groupflow.learner.auto_threshold import RunningProbabilityThreshold

# DeepSpeed's tag: the subdirectory of the learner directory its files go to.
TAG = "zero"


def _rng_file(directory: Path, rank: int) -> Path:
    return directory / f"rng_rank_{rank}.pt"


def _threshold_file(directory: Path, rank: int) -> Path:
    return directory / f"stapo_threshold_rank_{rank}.pt"


# Free space below which a failed save is taken for a full disk.
_FULL_BYTES = 16 * 2**20


@contextmanager
def saving_to(directory: str):
    """A failed write under `directory` (a full disk) as CheckpointError naming the path and
    the cause."""
    try:
        yield
    except OSError as err:
        where = err.filename or directory
        raise CheckpointError(f"{where}: the checkpoint was not saved ({err.strerror})") from None
    except Exception:
        # torch.save's zip writer and safetensors report a full disk as errors of their own
        if not _disk_full(directory):
            raise
        raise CheckpointError(
            f"{directory}: the checkpoint was not saved (no space left on the device)"
        ) from None


def save_rank_checkpoint(
    zero_model,
    directory: str,
    rank: int,
    threshold: RunningProbabilityThreshold | None = None,
    adapters_only: bool = False,
) -> None:
    """Model and optimizer shards of this rank, its torch RNG state and its running STAPO
    threshold (with `tau_p: auto`). With `adapters_only` (LoRA) the model's frozen weights
    are left out: a resume loads them from the model path."""
    with saving_to(directory):
        zero_model.save_checkpoint(
            directory, tag=TAG, save_latest=False, exclude_frozen_parameters=adapters_only
        )
        torch.save(torch.get_rng_state(), _rng_file(Path(directory), rank))
        if threshold is not None:
            torch.save(threshold.state_dict(), _threshold_file(Path(directory), rank))


def _disk_full(directory: str) -> bool:
    existing = Path(directory)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent  # a save can fail before its directory is made
    fs = os.statvfs(existing)
    return fs.f_bavail * fs.f_frsize < _FULL_BYTES


class _RestrictedReads:
    """DeepSpeed's checkpoint engine for the length of a load, its reads made restricted."""

    def __init__(self, zero_model):
        self.checkpoint_engine = zero_model.checkpoint_engine

    def __enter__(self):
        self.checkpoint_engine.load = self._load

    def __exit__(self, *_exc) -> None:
        del self.checkpoint_engine.load  # the class's own method again

    @staticmethod
    def _load(path: str, map_location=None):
        return restricted_load(Path(path), map_location=map_location)


def load_rank_checkpoint(
    zero_model,
    directory: str,
    rank: int,
    threshold: RunningProbabilityThreshold | None = None,
    adapters_only: bool = False,
) -> str | None:
    """Restore what save_rank_checkpoint wrote into a ZeRO-3 model built for the same model and
    world size, and into `threshold` (with `tau_p: auto`). A line for the driver's log when
    the checkpoint has no threshold to restore and it starts afresh, else None."""
    with _RestrictedReads(zero_model):
        path, _ = zero_model.load_checkpoint(
            directory,
            tag=TAG,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
            # a LoRA checkpoint holds the adapters only; the frozen weights stay as loaded
            load_module_strict=not adapters_only,
        )
    if path is None:
        raise FileNotFoundError(f"{directory}/{TAG}: no DeepSpeed checkpoint")
    torch.set_rng_state(restricted_load(_rng_file(Path(directory), rank)))
    return None if threshold is None else _restore_threshold(threshold, Path(directory), rank)


def _restore_threshold(
    threshold: RunningProbabilityThreshold, directory: Path, rank: int
) -> str | None:
    path = _threshold_file(directory, rank)
    afresh = "stapo.tau_p: auto: the threshold starts afresh"
    if not path.is_file():
        # a checkpoint saved before the threshold was saved, or by a run with a fixed tau_p
        return f"{afresh} ({directory} holds no running threshold)"
    state = restricted_load(path)
    try:
        restored = threshold.load_state_dict(state)
    except ValueError as err:
        raise CheckpointError(f"{path}: not a running threshold ({err})") from None
    return None if restored else f"{afresh} ({path} was counted in other bins)"
