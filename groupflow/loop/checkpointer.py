"""A job's checkpoints: what each part of the job keeps in one, and the save and restore.

Every part of a job that has state gives it by `state_dict()` and takes it back by
`load_state_dict()`; the checkpointer collects them, by part name, into the driver's state
(`DriverState`), beside the step, the policy version (the pipeline's, groupflow/loop/pipeline.py)
and what the checkpoint fits (its provenance: model, rank count, adapters). The parts:

  prompt_stream   where the prompt stream stands (groupflow/loop/prompt_stream.py)
  restarts        the restart budget's totals (groupflow/core/recovery.py)
  reward_totals   the reward pool's errors and timeouts (groupflow/loop/reward_totals.py)
  held_out        the held-out scores before training (groupflow/loop/held_out.py)

The learner ranks save their own share beside it (learner/checkpoint.py): the ZeRO-3 model
and optimizer shards, the RNG and, with `stapo.tau_p: auto`, the running STAPO threshold.

A checkpoint holds the job as it was after its step: the parts' states are taken as each step
ends (`step_ended`), so a save at a stop holds nothing of a step the stop abandoned. A save
every `trainer.checkpoint_every` steps draws the next step's prompts first: the ranks write
their shards while the engines generate them. A resumed job (`restore`) trains the same
prompts in the same order. The files on disk are groupflow/loop/checkpoint.py's.

Format 1, the driver state of groupflow before the checkpointer (each part's state in a field
of its own: `stream`, `counters`, `warm_start_*`), is read as the same parts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    model_validator,
)

from groupflow.config import Config, resolved_yaml
from groupflow.core.adapters import adapter_shape
from groupflow.core.errors import CheckpointError
from groupflow.core.peers import Learner, PeerDied
from groupflow.core.recovery import LearnerLost
from groupflow.loop.checkpoint import (
    HF_DIR,
    LEARNER_DIR,
    STATE_FILE,
    Checkpointing,
    CheckpointStore,
    FileRecord,
    Provenance,
    check_fit,
    read_state,
    step_dir_name,
)
from groupflow.loop.pipeline import Pipeline
from groupflow.loop.prompt_stream import StreamState

log = logging.getLogger(__name__)

FORMAT = 2


class Parts(BaseModel):
    """Each part's `state_dict()`, by part name: what a restore hands back to it."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    prompt_stream: StreamState
    restarts: dict[str, NonNegativeInt]
    reward_totals: dict[str, NonNegativeFloat]
    # every held-out score before the first step: eval_* keys, some by task or by set
    held_out: dict[str, float | dict[str, float | dict[str, float]]]


class DriverState(BaseModel):
    """What the driver needs to go on where a checkpoint left off."""

    model_config = ConfigDict(extra="forbid")

    format: Literal[2] = FORMAT
    step: int = Field(ge=0)  # the last step trained
    policy_version: int = Field(ge=0)
    provenance: Provenance
    parts: Parts
    # relative path -> size and hash of every other file of the checkpoint
    files: dict[str, FileRecord] = {}

    @model_validator(mode="before")
    @classmethod
    def _older_formats(cls, data: Any) -> Any:
        if isinstance(data, dict) and "format" not in data:
            return _from_format_1(data)
        return data


_FORMAT_1_PARTS = {"stream", "prompts_consumed", "counters"}
_FORMAT_1_HELD_OUT = {"warm_start_accuracy", "warm_start_eval"}
_FORMAT_1_PROVENANCE = {"model_config_json", "num_ranks", "adapter"}


def _from_format_1(old: dict) -> dict:
    """A format 1 driver state as format 2. The values move unchecked (the model checks
    them), and a key format 1 did not have stays, to be refused by name."""
    new: dict = {"format": FORMAT, "parts": {}}
    parts = new["parts"]
    new["provenance"] = {k: v for k, v in old.items() if k in _FORMAT_1_PROVENANCE}
    for key, value in old.items():
        if key not in _FORMAT_1_PARTS | _FORMAT_1_HELD_OUT | _FORMAT_1_PROVENANCE:
            new[key] = value
    if "stream" in old:
        parts["prompt_stream"] = old["stream"]
        if "prompts_consumed" in old:
            new["prompts_consumed"] = old["prompts_consumed"]  # one or the other
    elif "prompts_consumed" in old:  # the stream's position before it had a state
        parts["prompt_stream"] = {"consumed": old["prompts_consumed"]}
    counters = old.get("counters")
    if isinstance(counters, dict):  # the running totals and the restarts, in one dict
        parts["restarts"] = {k: v for k, v in counters.items() if k.endswith("_restarts")}
        parts["reward_totals"] = {k: v for k, v in counters.items() if k.startswith("reward_")}
    elif "counters" in old:
        parts["restarts"] = parts["reward_totals"] = counters
    scores = old.get("warm_start_eval", {})  # {} in the oldest: their accuracy alone
    accuracy = old.get("warm_start_accuracy")
    if isinstance(scores, dict) and accuracy is not None:
        scores = {"eval_accuracy": accuracy} | scores
    parts["held_out"] = scores
    return new


def read_checkpoint(
    path: Path, model_config_json: dict, num_ranks: int, adapter: dict | None = None
) -> DriverState:
    """The driver state of the checkpoint at `path`, if it can resume a job of this model,
    rank count and adapter shape (groupflow/loop/checkpoint.py `check_fit`); otherwise
    CheckpointError naming the file or the config key."""
    state = read_state(path, DriverState)
    now = Provenance(model_config_json=model_config_json, num_ranks=num_ranks, adapter=adapter)
    check_fit(path, state.files, state.provenance, now)
    return state


@dataclass
class Resume:
    """A checkpoint to go on from, and its driver state (read once)."""

    checkpoint: Path
    state: DriverState


def find_resume(resume: str | None, store: CheckpointStore) -> Resume | None:
    """The checkpoint `trainer.resume` names in `store`, with its driver state (read once), or
    None for a fresh run; CheckpointError naming the key or the file otherwise."""
    checkpoint = store.target(resume)
    if checkpoint is None:
        return None
    state = read_state(checkpoint, DriverState)
    if checkpoint.name.startswith("step_") and checkpoint.name != step_dir_name(state.step):
        raise CheckpointError(
            f"{checkpoint / STATE_FILE}: saved after step {state.step}, in the directory of "
            f"another step (a save names it {step_dir_name(state.step)})"
        )
    return Resume(checkpoint, state)


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class Checkpointer:
    """Saves a job's checkpoints (with `checkpointing`; None: never) and restores a job from
    one. `parts` are the job's parts with state, by the names `Parts` gives them."""

    def __init__(
        self,
        cfg: Config,
        checkpointing: Checkpointing | None,
        learner: Learner,
        pipeline: Pipeline,
        parts: dict[str, Stateful],
    ):
        self.cfg = cfg
        self.checkpointing = checkpointing
        self.learner = learner
        self.pipeline = pipeline
        self.parts = parts
        self._after_step: Parts | None = None  # the parts' states after the last step trained
        self._saved_step: int | None = None  # the step of the newest checkpoint
        self._last_save: float | None = None  # seconds the newest save took
        self._saved_at = time.monotonic()  # when the newest checkpoint was complete

    def step_ended(self, step: int, draw_next: Callable[[], bool]) -> None:
        """After `step` was trained and recorded: its state is kept, and saved on schedule
        (the next step's prompts drawn first unless `draw_next()` says no: a stop is asked)."""
        self._after_step = Parts.model_validate({n: p.state_dict() for n, p in self.parts.items()})
        if self._saving() and step % self.cfg.trainer.checkpoint_every == 0:
            self._save(step, draw_next())

    def save_at_stop(self, last_step: int) -> None:
        """A stop: the last step trained is saved, unless it was saved already."""
        if self._saving() and last_step > 0 and self._saved_step != last_step:
            self._save(last_step, draw_next=False)

    def _saving(self) -> bool:
        return self.checkpointing is not None and self.cfg.trainer.checkpoint_every > 0

    def _save(self, step: int, draw_next: bool) -> None:
        """Save the state after `step`: the ranks write their shards while the engines
        generate the next step's prompts (drawn first, at staleness 0, unless not
        `draw_next`). Says where, and how long it took."""
        started = time.monotonic()
        trainer, ckpt = self.cfg.trainer, self.checkpointing
        if draw_next and step < trainer.steps:
            self.pipeline.draw_ahead(self.cfg.rollout.prompts_per_step)
        staging = ckpt.store.staging(step)
        try:
            self.pipeline.wait_for(self.learner.async_save_checkpoint(str(staging / LEARNER_DIR)))
        except PeerDied as err:
            raise LearnerLost(f"a learner rank died in a checkpoint save: {err}") from err
        if trainer.save_hf_every and step % trainer.save_hf_every == 0:
            self.learner.save_pretrained(str(staging / HF_DIR))
            ckpt.add_tokenizer(staging / HF_DIR)
        provenance = Provenance(
            model_config_json=ckpt.model_config_json,
            num_ranks=self.learner.num_ranks,
            adapter=adapter_shape(self.cfg.learner.lora),
        )
        state = DriverState(
            step=step,
            policy_version=self.pipeline.version,
            provenance=provenance,
            parts=self._after_step,
        )
        saved = ckpt.store.commit(
            staging, step, state, resolved_yaml(self.cfg), trainer.keep_checkpoints
        )
        self._saved_at = time.monotonic()
        self._last_save = self._saved_at - started
        self._saved_step = step
        log.info("checkpoint of step %d saved to %s in %.1fs", step, saved, self._last_save)

    def figures(self) -> dict[str, float]:
        """The checkpoints' part of a step record (when the job saves any)."""
        if self.checkpointing is None:
            return {}
        figures = {"seconds_since_checkpoint": time.monotonic() - self._saved_at}
        if self._last_save is not None:
            figures["checkpoint_seconds"] = self._last_save
        return figures

    def restore(self, checkpoint: Path, state: DriverState) -> None:
        """The job as `checkpoint` left it: the learner's shards, the engines on its policy
        version, every part at its state."""
        self.learner.load_checkpoint(str(checkpoint / LEARNER_DIR))
        self.pipeline.restored(state.policy_version)
        for name, part in self.parts.items():
            part.load_state_dict(getattr(state.parts, name))
        self._after_step, self._saved_step = state.parts, state.step
