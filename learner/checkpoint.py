"""A rank's share of a checkpoint: DeepSpeed's own save and load of the ZeRO-3 model and
optimizer shards (each rank writes and reads only its own partition), plus the rank's RNG.

Both are collective: every rank calls them together with the same directory. The directory
is a staging name the driver renames once every rank has returned (groupflow/checkpoint.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

# DeepSpeed's tag: the subdirectory of the learner directory its files go to.
TAG = "zero"


def _rng_file(directory: Path, rank: int) -> Path:
    return directory / f"rng_rank_{rank}.pt"


def save_rank_checkpoint(engine, directory: str, rank: int) -> None:
    """Model and optimizer shards of this rank, and its torch RNG state."""
    engine.save_checkpoint(directory, tag=TAG, save_latest=False)
    torch.save(torch.get_rng_state(), _rng_file(Path(directory), rank))


def load_rank_checkpoint(engine, directory: str, rank: int) -> None:
    """Restore what save_rank_checkpoint wrote into an engine built for the same model and
    world size."""
    path, _ = engine.load_checkpoint(
        directory, tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if path is None:
        raise FileNotFoundError(f"{directory}/{TAG}: no DeepSpeed checkpoint")
    torch.set_rng_state(torch.load(_rng_file(Path(directory), rank)))
