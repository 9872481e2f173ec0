"""The `task` section: what the model is trained on, and the held-out sets it is evaluated on.

Task names and each task's options are checked against the task registry by
`groupflow.config.load.resolve`, not here: the models import no registry."""

from __future__ import annotations

from typing import Any

from pydantic import Field, StrictInt, model_validator

from groupflow.config.base import Section


class EvalSetConfig(Section):
    """One more held-out set, evaluated beside the job's own."""

    name: str = Field(
        pattern=r"^[A-Za-z0-9_.-]+$", description="its label in the metrics (eval_set_*)"
    )
    task: str = Field(description="a built-in task whose held-out prompts make the set")
    options: dict[str, Any] = Field(default_factory=dict, description="that task's settings")
    size: StrictInt = Field(256, ge=1, description="held-out prompts in the set")


class TaskConfig(Section):
    """What the model is trained on: the task that makes the prompts and scores the responses."""

    name: str = Field(
        "arithmetic",
        description="a built-in task (see reward_workers.tasks); a list of tasks under `task` "
        "mixes several in one job, each with a weight",
    )
    options: dict[str, Any] = Field(default_factory=dict, description="task-specific settings")
    eval_size: StrictInt = Field(
        256,
        ge=1,
        description="held-out prompts for greedy accuracy (all of them where the task has fewer)",
    )
    chat_template: str = Field(
        "auto",
        min_length=1,
        description="how prompts are rendered: 'auto' = the tokenizer's chat template when it "
        "has one (with a generation prompt), 'none' = raw text, or a Jinja template file",
    )
    system_prompt: str | None = Field(
        None, description="a system turn before every prompt (needs a chat template)"
    )
    seed: StrictInt = Field(
        1234, description="seed of the task's prompt stream and of its held-out split"
    )
    eval_sets: list[EvalSetConfig] = Field(
        default_factory=list,
        description="more held-out sets, evaluated with the job's own (e.g. another task's "
        "problems); each is reported under its name",
    )

    @model_validator(mode="after")
    def _distinct_eval_sets(self) -> TaskConfig:
        names = [s.name for s in self.eval_sets]
        if len(set(names)) < len(names):
            raise ValueError(f"eval_sets: names must differ (got {names})")
        return self
