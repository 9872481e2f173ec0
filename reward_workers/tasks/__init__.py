"""Built-in tasks by name, each imported only when used (a scorer process for arithmetic
need not import sympy, which the math task does: half a second per process start).

A task is the job's prompt source as well as its verifier (tasks/base.py: Task): the driver's
prompt stream (groupflow/loop/prompt_stream.py) draws the training prompts from `train_prompts` and
the held-out evaluation from `eval_prompts`, while the reward workers call `verify`."""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
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
    # several of the above in one job: groupflow/config/load.py reads it from a list under `task`
    "mixture": ("mixture", "MixtureTask"),
}
# Tasks of installed environment packages, named `<package>:<what of it>`
# (`reasoning_gym:chain_sum`, `verifiers:my_taskset`; docs/environments.md): package ->
# (module, class). The module's `declared_options(what)` are the task's options, and the
# class is built with what the name names and those options.
PACKAGE_TASKS: dict[str, tuple[str, str]] = {
    "reasoning_gym": ("reasoning_gym_task", "ReasoningGymTask"),
    "verifiers": ("verifiers_task", "VerifiersTask"),
}


def package_task(name: str) -> tuple[str, str] | None:
    """(package, what it names) for a package task's name, None for a built-in name."""
    package, sep, target = name.partition(":")
    if not sep:
        return None
    if package not in PACKAGE_TASKS or not target:
        raise ValueError(
            f"task.name: {name!r} names no package task; write one of "
            f"{', '.join(p + ':<name>' for p in PACKAGE_TASKS)}"
        )
    return package, target


def is_task(name: str) -> bool:
    """Whether `name` is a built-in task or names a package task (what it names is checked
    with its options)."""
    return name in TASKS or (":" in name and name.partition(":")[0] in PACKAGE_TASKS)


def task_class(name: str) -> type:
    package = package_task(name)
    if package is not None:
        module, cls = PACKAGE_TASKS[package[0]]
    elif name not in TASKS:
        raise ValueError(f"task.name: unknown task {name!r}; choose one of {sorted(TASKS)}")
    else:
        module, cls = TASKS[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def own_harness(name: str, options: dict[str, Any]) -> str | None:
    """'module:name' of the harness that plays task `name`'s trajectories where the task
    brings its own program (a multi-turn verifiers taskset's), else None; ValueError for a
    task whose program groupflow cannot play."""
    package = package_task(name)
    if package is None:
        return None
    own = getattr(importlib.import_module(task_class(name).__module__), "own_harness", None)
    return None if own is None else own(package[1], options)


@functools.cache
def task_options(name: str) -> dict[str, inspect.Parameter]:
    """The options a task takes, by name: its constructor's parameters, with their types and
    defaults. The constructor is the one place a task declares them; the config is checked
    against it (`check_options`) before anything is built. A package task declares its own
    (`declared_options` of its module), which may depend on what it names."""
    package = package_task(name)
    if package is not None:
        cls = task_class(name)
        return importlib.import_module(cls.__module__).declared_options(package[1])
    signature = inspect.signature(task_class(name), eval_str=True)
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name: p for p in signature.parameters.values() if p.kind in keyword}


def check_options(name: str, options: dict[str, Any], where: str) -> None:
    """Every option known to task `name` and of its declared type, or ValueError naming the
    key under `where` (e.g. "task.options"). Ranges and files are the constructor's to check,
    when the task is built."""
    known = task_options(name)
    for key, value in options.items():
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ValueError(
                f"{where}.{key}: unknown option of task {name}; known: {', '.join(known)}{hint}"
            )
        problem = _type_problem(known[key].annotation, value)
        if problem is not None:
            inner, message, got = problem
            raise ValueError(f"{where}.{key}{inner}: {message} (got {_short_repr(got)})")


@functools.cache
def _adapter(annotation: Any):
    from pydantic import ConfigDict, TypeAdapter

    # Strict: a task gets the value as written, so "3" for an int is refused, not converted.
    return TypeAdapter(annotation, config=ConfigDict(strict=True))


def _type_problem(annotation: Any, value: Any) -> tuple[str, str, Any] | None:
    """(where inside the value, what is wrong, the wrong part) when `value` is not of the
    type, else None."""
    from pydantic import ValidationError

    if annotation is inspect.Parameter.empty:
        return None
    try:
        _adapter(annotation).validate_python(value)
    except ValidationError as err:
        first = err.errors()[0]
        message = first["msg"]
        return _inner_key(value, first["loc"]), message[:1].lower() + message[1:], first["input"]
    return None


def _inner_key(value: Any, loc: tuple) -> str:
    """Where in `value` an error's location points, as `.key` and `[index]`; the names of a
    union's members, which pydantic puts in the location too, are not in the value: skipped."""
    key, node = "", value
    for part in loc:
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            key += f".{part}"
        elif isinstance(node, list | tuple) and isinstance(part, int) and 0 <= part < len(node):
            key += f"[{part}]"
        else:
            continue
        node = node[part]
    return key


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def make_task(name: str, options: dict[str, Any] | None = None) -> Task:
    cls = task_class(name)
    check_options(name, options or {}, "task.options")
    package = package_task(name)
    try:
        if package is not None:
            return cls(package[1], **(options or {}))
        return cls(**(options or {}))
    except TypeError as err:
        raise ValueError(f"task.options: {err}") from None
