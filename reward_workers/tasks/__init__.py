"""Built-in tasks by name."""

from __future__ import annotations

from typing import Any

from groupflow.reward_workers.tasks.arithmetic import ArithmeticTask
from groupflow.reward_workers.tasks.base import Task
from groupflow.reward_workers.tasks.code_problems import CodeTask
from groupflow.reward_workers.tasks.countdown import CountdownTask
from groupflow.reward_workers.tasks.knights import KnightsAndKnavesTask
from groupflow.reward_workers.tasks.math_problems import MathTask

TASKS: dict[str, type] = {
    "arithmetic": ArithmeticTask,
    "countdown": CountdownTask,
    "knights_and_knaves": KnightsAndKnavesTask,
    "math": MathTask,
    "code": CodeTask,
}


def make_task(name: str, options: dict[str, Any] | None = None) -> Task:
    if name not in TASKS:
        raise ValueError(f"task.name: unknown task {name!r}; choose one of {sorted(TASKS)}")
    try:
        return TASKS[name](**(options or {}))
    except TypeError as err:
        raise ValueError(f"task.options: {err}") from None
