"""A run's checkpoints on disk: layout, the all-or-nothing commit, retention, and the checks
that decide whether a checkpoint may resume a job.

runs/<name>/checkpoints/
  step_<N>/                  complete checkpoints only (a rename makes them appear whole)
    learner/                 DeepSpeed's own checkpoint: ZeRO-3 model and optimizer shards,
                             one file per rank, written by the ranks (learner/checkpoint.py)
    hf/                      the policy in Hugging Face format (trainer.save_hf_every)
    driver_state.json        the driver's state (groupflow/loop/checkpointer.py) and a manifest
    config.resolved.yaml     the config the run had when it saved
  .staging-step_<N>/         a save in progress; a crash leaves it behind and it is ignored

The manifest (every file's size and SHA-256) is written last, just before the rename. Before
anything of a checkpoint is loaded, every file is checked against it (a file cut short, changed
or added after the save is refused), and every pickle in it (DeepSpeed's shards, the ranks'
RNG states and STAPO thresholds) is opened by the restricted unpickler
(groupflow/core/safe_pickle.py), which runs no code: the hashes catch accidents, the restricted
unpickler is the wall against a crafted file (whoever can rewrite a shard can rewrite the
manifest too). The ranks load through the same unpickler.

A driver holds one store for its run (groupflow/run/driver.py): the resume, the saves, the
rebuild of a lost learner and the summary all go through it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field

from groupflow.core.errors import CheckpointError
from groupflow.core.safe_pickle import restricted_load
from groupflow.loop.checkpoint_adapters import check_adapter_record

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
STATE_FILE = "driver_state.json"
CONFIG_FILE = "config.resolved.yaml"
LEARNER_DIR = "learner"
HF_DIR = "hf"
STAGING_PREFIX = ".staging-"
_STEP_DIR = re.compile(r"step_(\d+)")
PICKLE_SUFFIX = ".pt"  # torch.save's files: DeepSpeed's shards, the ranks' own states

_State = TypeVar("_State", bound=BaseModel)


class FileRecord(BaseModel):
    """What a checkpoint's file was when it was saved."""

    model_config = ConfigDict(extra="forbid")

    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Provenance(BaseModel):
    """What a checkpoint fits: the model it was trained from, the ranks its ZeRO-3 shards are
    cut for, and the adapters' shape (LoRA)."""

    model_config = ConfigDict(extra="forbid")

    model_config_json: dict  # the model's config.json: a checkpoint fits one model only
    num_ranks: int = Field(ge=1)  # ZeRO-3 shards are cut for this many ranks
    # With LoRA, the adapters' shape (groupflow/core/adapters.py `adapter_shape`): the checkpoint
    # holds them, not the model. None: the whole model.
    adapter: dict | None = None


@dataclass
class Checkpointing:
    """Where a job saves its checkpoints, and what it tells about its model."""

    store: CheckpointStore
    model_config_json: dict  # the model's config.json, so that a resume can check the model
    # completes a Hugging Face save: tokenizer, chat template... (groupflow/loop/saved_model.py)
    add_tokenizer: Callable[[Path], None]


def step_dir_name(step: int) -> str:
    return f"step_{step}"


class CheckpointStore:
    """The checkpoints of one run directory."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.root = run_dir / CHECKPOINTS

    def staging(self, step: int) -> Path:
        """An empty directory for the save of `step`, under a name no reader takes as a
        checkpoint (a leftover of a crashed save of the same step is cleared first)."""
        path = self.root / f"{STAGING_PREFIX}{step_dir_name(step)}"
        try:
            _remove(path)
            path.mkdir(parents=True)
        except OSError as err:
            raise _save_failed(step, err, path) from None
        return path

    def commit(
        self, staging: Path, step: int, state: BaseModel, config_yaml: str, keep: int
    ) -> Path:
        """Add the driver's files and the manifest, make the checkpoint of `step` appear whole
        under its final name, and drop all but the newest `keep`. The ranks have finished
        writing; `state` is the driver's, its `files` filled with the manifest here. A save
        that fails (a full disk) is cleared away and raised as one line; the previous
        checkpoint stays the newest."""
        final = self.root / step_dir_name(step)
        try:
            (staging / CONFIG_FILE).write_text(config_yaml)
            state = state.model_copy(update={"files": _manifest(staging)})
            _write_synced(staging / STATE_FILE, state.model_dump_json(indent=1))
            _remove(final)  # a resumed run saving a step again: the new save replaces it
            os.rename(staging, final)
            _sync_dir(self.root)
        except OSError as err:
            shutil.rmtree(staging, ignore_errors=True)
            raise _save_failed(step, err, staging) from None
        self.prune(keep)
        return final

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first: directories of their own, never symlinks."""
        if not self.root.is_dir():
            return []
        found = [
            (int(m.group(1)), p)
            for p in self.root.iterdir()
            if (m := _STEP_DIR.fullmatch(p.name)) and _is_real_dir(p)
        ]
        return [p for _, p in sorted(found)]

    def newest(self) -> Path | None:
        done = self.complete()
        return done[-1] if done else None

    def target(self, resume: str | None) -> Path | None:
        """The checkpoint `trainer.resume` asks for, or None for a fresh run."""
        if resume in (None, "never"):
            return None
        self._refuse_strays()
        if resume in ("auto", "latest"):
            newest = self.newest()
            if newest is None and resume == "latest":
                raise CheckpointError(f"trainer.resume: no complete checkpoint under {self.root}")
            return newest
        path = Path(resume)
        if not path.is_dir():
            raise CheckpointError(f"trainer.resume: {path} is not a checkpoint directory")
        # Resuming rewinds this run's metrics.jsonl to the checkpoint's step: only a checkpoint
        # of this run may do that.
        if path.resolve().parent != self.root.resolve():
            raise CheckpointError(
                f"trainer.resume: {path} is not a checkpoint of the run {self.run_dir} "
                f"(its checkpoints are in {self.root})"
            )
        return path

    def _refuse_strays(self) -> None:
        """A resume reads this directory as the saves left it: an entry named like a
        checkpoint that no save makes (a file or symlink `step_7`, a `step_007`) is refused,
        naming it, rather than passed over or taken for a checkpoint."""
        if not self.root.is_dir():
            return
        for entry in sorted(self.root.iterdir()):
            m = _STEP_DIR.fullmatch(entry.name)
            if m is None:
                continue
            if not _is_real_dir(entry):
                raise CheckpointError(
                    f"{entry}: not a checkpoint directory among the checkpoints; remove it"
                )
            if entry.name != step_dir_name(int(m.group(1))):
                raise CheckpointError(
                    f"{entry}: not a checkpoint's name (a save names it "
                    f"{step_dir_name(int(m.group(1)))}); remove or rename it"
                )

    def prune(self, keep: int) -> None:
        """Keep the newest `keep` checkpoints; drop older ones and abandoned staging dirs.
        Pruning follows no symlink, and a failure is logged: the save it follows succeeded."""
        for old in [*self.complete()[:-keep], *self.root.glob(f"{STAGING_PREFIX}*")]:
            try:
                _remove(old)
            except OSError as err:
                log.warning("could not remove the old checkpoint %s: %s", old, err.strerror)


def _is_real_dir(path: Path) -> bool:
    return stat.S_ISDIR(path.lstat().st_mode)


def _remove(path: Path) -> None:
    """Delete a directory tree, or a symlink itself (never what it points to)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _save_failed(step: int, err: OSError, path: Path) -> CheckpointError:
    where = err.filename or path
    return CheckpointError(f"{where}: the checkpoint of step {step} was not saved ({err.strerror})")


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _manifest(directory: Path) -> dict[str, FileRecord]:
    return {
        p.relative_to(directory).as_posix(): FileRecord(size=p.stat().st_size, sha256=_sha256(p))
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


def verify_files(path: Path, files: dict[str, FileRecord]) -> None:
    """Every file of the checkpoint at `path` as the manifest recorded it at the save: no
    file missing, cut short, changed or added, none a symlink or outside the checkpoint."""
    for name, record in files.items():
        relative = PurePosixPath(name)
        if relative.is_absolute() or ".." in relative.parts or name == STATE_FILE:
            raise CheckpointError(f"{path / STATE_FILE}: the manifest names {name!r}")
        f = path / relative
        if not f.is_file() or f.is_symlink():
            raise CheckpointError(f"{f}: missing from the checkpoint (or not a plain file)")
        size = f.stat().st_size
        if size != record.size:
            raise CheckpointError(f"{f}: truncated or grown ({size} of {record.size} bytes)")
        if _sha256(f) != record.sha256:
            raise CheckpointError(f"{f}: changed since the checkpoint was saved (SHA-256 differs)")
    for f in sorted(path.rglob("*")):
        name = f.relative_to(path).as_posix()
        if name not in files and name != STATE_FILE and (f.is_symlink() or not f.is_dir()):
            raise CheckpointError(f"{f}: not in the checkpoint when it was saved")


def check_pickles(path: Path, files: dict[str, FileRecord]) -> None:
    """Open every pickle of the checkpoint with the restricted unpickler, its tensors mapped
    rather than read: a crafted file is refused before any rank loads the checkpoint."""
    for name in files:
        if name.endswith(PICKLE_SUFFIX):
            restricted_load(path / name, map_location="cpu", mmap=True)


def read_state(path: Path, model: type[_State]) -> _State:
    """The driver's state file of the checkpoint at `path`, read as `model`; CheckpointError
    naming the file where it is missing or not such a state."""
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise CheckpointError(f"{state_file}: missing (not a complete groupflow checkpoint)")
    try:
        return model.model_validate_json(state_file.read_text())
    except ValueError as err:
        raise CheckpointError(f"{state_file}: unreadable ({_first_error(err)})") from None


def check_fit(path: Path, files: dict[str, FileRecord], saved: Provenance, now: Provenance) -> None:
    """That the checkpoint at `path`, with the manifest `files`, saved for `saved`, can resume
    a job of `now`: every file as it was saved, the learner's state there, the same model,
    rank count and adapter shape (LoRA; None: the whole model is trained), every pickle
    plain data, and the saved tensors what the adapter record says. Otherwise CheckpointError naming the file or the config key."""
    verify_files(path, files)
    if not any(name.startswith(f"{LEARNER_DIR}/") for name in files):
        raise CheckpointError(f"{path / LEARNER_DIR}: no learner state in the checkpoint")
    changed = _first_difference(saved.model_config_json, now.model_config_json)
    if changed is not None:
        raise CheckpointError(
            f"model.path: {path} was trained from another model (config.json {changed})"
        )
    if saved.num_ranks != now.num_ranks:
        raise CheckpointError(
            f"learner.num_ranks: {now.num_ranks}, but {path} holds ZeRO-3 shards of "
            f"{saved.num_ranks} ranks"
        )
    if saved.adapter != now.adapter:
        raise CheckpointError(f"learner.lora: {_adapter_words(now.adapter, path, saved.adapter)}")
    check_pickles(path, files)
    # the record is outside the manifest's hashes: it must say what the tensors are
    learner_files = [name for name in files if name.startswith(f"{LEARNER_DIR}/")]
    check_adapter_record(path, learner_files, saved.adapter, path / STATE_FILE)


def _adapter_words(now: dict | None, path: Path, saved: dict | None) -> str:
    if saved is None:
        return f"{path} trained the whole model, not LoRA adapters"
    if now is None:
        return f"unset, but {path} holds LoRA adapters ({_shape(saved)}), not a whole model"
    changed = _first_difference(saved, now)
    return f"{path} holds adapters of another shape ({changed})"


def _shape(adapter: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in adapter.items())


def _first_error(err: ValueError) -> str:
    """A pydantic error's first complaint, with its field, on one line."""
    lines = [line.strip() for line in str(err).splitlines() if "further information" not in line]
    return " ".join(lines[1:3]) if len(lines) > 1 else lines[0]


# Keys of config.json that name where or how a model was saved, not what it is.
_PROVENANCE_KEYS = {"_name_or_path", "transformers_version", "torch_dtype", "dtype"}


def _first_difference(saved: dict, current: dict) -> str | None:
    for key in sorted((saved.keys() | current.keys()) - _PROVENANCE_KEYS):
        if saved.get(key) != current.get(key):
            return f"{key}: {saved.get(key)!r} in the checkpoint, {current.get(key)!r} now"
    return None


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
