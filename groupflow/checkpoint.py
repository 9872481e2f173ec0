"""A run's checkpoints on disk: layout, the all-or-nothing commit, retention, and the checks
that decide whether a checkpoint may resume a job.

runs/<name>/checkpoints/
  step_<N>/                  complete checkpoints only (a rename makes them appear whole)
    learner/                 DeepSpeed's own checkpoint: ZeRO-3 model and optimizer shards,
                             one file per rank, written by the ranks (learner/checkpoint.py)
    hf/                      the policy in Hugging Face format (trainer.save_hf_every)
    driver_state.json        DriverState: the job's position and counters, and a manifest
    config.resolved.yaml     the config the run had when it saved
  .staging-step_<N>/         a save in progress; a crash leaves it behind and it is ignored

The manifest (every file's size) is written last, just before the rename: a checkpoint whose
files do not match it was cut short after the fact (a disk copy, a full disk) and is refused.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from pydantic import BaseModel

CHECKPOINTS = "checkpoints"
STATE_FILE = "driver_state.json"
CONFIG_FILE = "config.resolved.yaml"
LEARNER_DIR = "learner"
HF_DIR = "hf"
STAGING_PREFIX = ".staging-"
_STEP_DIR = re.compile(r"step_(\d+)")


class CheckpointError(ValueError):
    """A checkpoint that cannot resume this job, phrased as one line naming the file or key."""


class DriverState(BaseModel):
    """What the driver needs to go on where a checkpoint left off."""

    step: int  # the last step trained
    policy_version: int
    prompts_consumed: int  # prompts of the seeded stream used by steps 1..step
    warm_start_accuracy: float | None
    counters: dict[str, float]  # running totals reported in the step records
    model_config_json: dict  # the model's config.json: a checkpoint fits one model only
    num_ranks: int  # ZeRO-3 shards are cut for this many ranks
    files: dict[str, int] = {}  # relative path -> size of every other file of the checkpoint


def step_dir_name(step: int) -> str:
    return f"step_{step}"


class CheckpointStore:
    """The checkpoints of one run directory."""

    def __init__(self, run_dir: Path):
        self.root = run_dir / CHECKPOINTS

    def staging(self, step: int) -> Path:
        """An empty directory for the save of `step`, under a name no reader takes as a
        checkpoint (a leftover of a crashed save of the same step is cleared first)."""
        path = self.root / f"{STAGING_PREFIX}{step_dir_name(step)}"
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def commit(self, staging: Path, state: DriverState, config_yaml: str, keep: int) -> Path:
        """Add the driver's files and the manifest, make the checkpoint appear whole under its
        final name, and drop all but the newest `keep`. The ranks have finished writing."""
        (staging / CONFIG_FILE).write_text(config_yaml)
        state = state.model_copy(update={"files": _manifest(staging)})
        _write_synced(staging / STATE_FILE, state.model_dump_json(indent=1))
        final = self.root / step_dir_name(state.step)
        if final.exists():  # a resumed run saving a step again: the new save replaces it
            shutil.rmtree(final)
        os.rename(staging, final)
        _sync_dir(self.root)
        self.prune(keep)
        return final

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = [
            (int(m.group(1)), p) for p in self.root.iterdir() if (m := _STEP_DIR.fullmatch(p.name))
        ]
        return [p for _, p in sorted(found)]

    def newest(self) -> Path | None:
        done = self.complete()
        return done[-1] if done else None

    def prune(self, keep: int) -> None:
        """Keep the newest `keep` checkpoints; drop older ones and abandoned staging dirs."""
        for old in self.complete()[:-keep]:
            shutil.rmtree(old)
        for leftover in self.root.glob(f"{STAGING_PREFIX}*"):
            shutil.rmtree(leftover, ignore_errors=True)


def _manifest(directory: Path) -> dict[str, int]:
    return {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != STATE_FILE
    }


def _write_synced(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_checkpoint(path: Path, model_config_json: dict, num_ranks: int) -> DriverState:
    """The driver state of the checkpoint at `path`, if it can resume a job of this model and
    rank count; otherwise CheckpointError naming the file or the config key."""
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise CheckpointError(f"{state_file}: missing (not a complete groupflow checkpoint)")
    try:
        state = DriverState.model_validate_json(state_file.read_text())
    except ValueError as err:
        raise CheckpointError(f"{state_file}: unreadable ({str(err).splitlines()[0]})") from None
    for name, size in state.files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{f}: missing from the checkpoint")
        if f.stat().st_size != size:
            raise CheckpointError(f"{f}: truncated ({f.stat().st_size} of {size} bytes)")
    if not any(name.startswith(f"{LEARNER_DIR}/") for name in state.files):
        raise CheckpointError(f"{path / LEARNER_DIR}: no learner state in the checkpoint")
    changed = _first_difference(state.model_config_json, model_config_json)
    if changed is not None:
        raise CheckpointError(
            f"model.path: {path} was trained from another model (config.json {changed})"
        )
    if state.num_ranks != num_ranks:
        raise CheckpointError(
            f"learner.num_ranks: {num_ranks}, but {path} holds ZeRO-3 shards of "
            f"{state.num_ranks} ranks"
        )
    return state


# Keys of config.json that name where or how a model was saved, not what it is.
_PROVENANCE_KEYS = {"_name_or_path", "transformers_version", "torch_dtype", "dtype"}


def _first_difference(saved: dict, current: dict) -> str | None:
    for key in sorted((saved.keys() | current.keys()) - _PROVENANCE_KEYS):
        if saved.get(key) != current.get(key):
            return f"{key}: {saved.get(key)!r} in the checkpoint, {current.get(key)!r} now"
    return None


def resume_target(resume: str | None, run_dir: Path) -> Path | None:
    """The checkpoint `trainer.resume` asks for, or None for a fresh run."""
    if resume in (None, "never"):
        return None
    store = CheckpointStore(run_dir)
    if resume in ("auto", "latest"):
        newest = store.newest()
        if newest is None and resume == "latest":
            raise CheckpointError(f"trainer.resume: no complete checkpoint under {store.root}")
        return newest
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"trainer.resume: {path} is not a checkpoint directory")
    return path


def rewind_metrics(path: Path, step: int) -> None:
    """metrics.jsonl as it was when the checkpoint of `step` was saved: the records of later
    steps, which a resumed job writes again, are dropped. A step's record is written before
    its checkpoint, so the records up to `step` are all there. Replaced in one rename."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by the crash
        if record.get("step", 0) <= step:
            kept.append(line + "\n")
    tmp = path.with_name(f".{path.name}.rewind")
    _write_synced(tmp, "".join(kept))
    os.replace(tmp, path)
