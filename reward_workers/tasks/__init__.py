"""Built-in tasks by name, each imported only when used (a scorer process for arithmetic
need not import sympy, which the math task does: half a second per process start).

A task is the job's prompt source as well as its verifier (tasks/base.py: Task): the driver's
prompt stream (groupflow/prompt_stream.py) draws the training prompts from `train_prompts` and
the held-out evaluation from `eval_prompts`, while the reward workers call `verify`."""

from __future__ import annotations

import importlib
from typing import Any

from groupflow.reward_workers.tasks.base import Task

# name -> (module under groupflow.reward_workers.tasks, class)
TASKS: dict[str, tuple[str, str]] = {
    "arithmetic": ("arithmetic", "ArithmeticTask"),
    "long_addition": ("long_addition", "LongAdditionTask"),
    "countdown": ("countdown", "CountdownTask"),
    "knights_and_knaves": ("knights", "KnightsAndKnavesTask"),
    "math": ("math_problems", "MathTask"),
    "code": ("code_problems", "CodeTask"),
    # long products, answered with the calculator tool in a multi-turn trajectory
    "tool_arithmetic": ("tool_arithmetic", "ToolArithmeticTask"),
    # several of the above in one job: groupflow/config.py builds it from a list under `task`
    "mixture": ("mixture", "MixtureTask"),
}


def task_class(name: str) -> type:
    if name not in TASKS:
        raise ValueError(f"task.name: unknown task {name!r}; choose one of {sorted(TASKS)}")
    module, cls = TASKS[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def make_task(name: str, options: dict[str, Any] | None = None) -> Task:
    cls = task_class(name)
    try:
        return cls(**(options or {}))
    except TypeError as err:
        raise ValueError(f"task.options: {err}") from None
