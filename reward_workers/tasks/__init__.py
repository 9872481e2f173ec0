"""Built-in tasks by name."""

from __future__ import annotations

from typing import Any

from reward_workers.tasks.arithmetic import ArithmeticTask
from reward_workers.tasks.base import Task

TASKS: dict[str, type] = {"arithmetic": ArithmeticTask}


def make_task(name: str, options: dict[str, Any] | None = None) -> Task:
    if name not in TASKS:
        raise ValueError(f"task.name: unknown task {name!r}; choose one of {sorted(TASKS)}")
    try:
        return TASKS[name](**(options or {}))
    except TypeError as err:
        raise ValueError(f"task.options: {err}") from None
