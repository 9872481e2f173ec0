"""User reward plugins: `module:function` or `path/to/file.py:function`.

The function takes (prompt_text, response_text, answer) and returns a reward in [0, 1], or
(reward, info) where info becomes the reason; it may be sync or async. It runs in a scorer
process (reward_workers/verifier_pool.py) that is killed at the call's deadline. Whatever it
does per sample (raises anything, KeyboardInterrupt and SystemExit included, returns something
that is not a finite number in [0, 1], or an object whose conversion raises), the sample gets
Verdict(0.0, reason, error="error") and nothing is raised to the caller.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from groupflow.records import Prompt, Verdict


@dataclass(frozen=True)
class RewardPlugin:
    function: Callable[..., Any]
    name: str


def load_plugin(spec: str) -> RewardPlugin:
    """Import the plugin named by spec; ValueError (one line) if it cannot be loaded."""
    function = load_object(spec, "reward plugin")
    if not callable(function):
        raise ValueError(f"reward plugin {spec!r}: {spec.rpartition(':')[2]!r} is not a function")
    return RewardPlugin(function, name=spec.rpartition(":")[2])


def spec_file(spec: str) -> str | None:
    """The file that `path/to/file.py:name` loads from; None for `module:name`."""
    target, sep, _ = spec.rpartition(":")
    return target if sep and (target.endswith(".py") or "/" in target) else None


def load_object(spec: str, what: str) -> Any:
    """The object `module:name` or `path/to/file.py:name` names (a reward plugin, a tool, an
    environment); ValueError (one line, naming `what`) if it cannot be loaded."""
    target, sep, attribute = spec.rpartition(":")
    if not sep or not target or not attribute:
        raise ValueError(f"{what} {spec!r}: expected 'module:name' or 'file.py:name'")
    from_file = spec_file(spec) is not None
    if from_file and not Path(target).is_file():
        raise ValueError(f"{what} {spec!r}: no such file {target}")
    try:
        module = _load_file(Path(target)) if from_file else importlib.import_module(target)
    except BaseException as err:  # import-time errors and exits, whatever they are
        raise ValueError(
            f"{what} {spec!r}: import failed: {type(err).__name__}: {_short(err)}"
        ) from None
    if not hasattr(module, attribute):
        raise ValueError(f"{what} {spec!r}: {target} has no {attribute!r}")
    return getattr(module, attribute)


def call_plugin(
    plugin: RewardPlugin, prompt: Prompt, response: str, loop: asyncio.AbstractEventLoop
) -> Verdict:
    """One call; never raises. Async plugins run on the scorer process's own loop."""
    try:
        result = plugin.function(prompt.text, response, prompt.answer)
        if inspect.isawaitable(result):
            result = loop.run_until_complete(result)
        return _to_verdict(plugin.name, result)
    except BaseException as err:  # KeyboardInterrupt and SystemExit cost one sample too
        return Verdict(0.0, f"{plugin.name} raised {type(err).__name__}: {_short(err)}", "error")


def _to_verdict(name: str, result: Any) -> Verdict:
    info = None
    if isinstance(result, tuple) and len(result) == 2:
        result, info = result
    # numbers.Real takes numpy scalars too (plugins often return np.float32)
    if isinstance(result, bool) or not isinstance(result, numbers.Real):
        return Verdict(0.0, f"{name} returned {type(result).__name__}, not a number", "error")
    try:
        reward = float(result)
    except BaseException as err:  # 10**400, a __float__ that raises
        return Verdict(0.0, f"{name} returned a number float() refuses: {_short(err)}", "error")
    if not math.isfinite(reward) or not 0.0 <= reward <= 1.0:
        return Verdict(0.0, f"{name} returned {reward}, outside [0, 1]", "error")
    reason = f"{name}: {_short(info, 300)}" if info is not None else f"{name}: {reward:g}"
    return Verdict(reward, reason[:300])


def _load_file(file: Path) -> Any:
    # A module name unique to the file, registered so that code in the plugin (dataclasses,
    # for one) can find its own module.
    digest = hashlib.sha256(str(file.resolve()).encode()).hexdigest()[:12]
    name = f"groupflow_plugin_{file.stem}_{digest}"
    module_spec = importlib.util.spec_from_file_location(name, file)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"cannot load {file} as Python")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _short(value: object, limit: int = 200) -> str:
    """One line of str(value), bounded; an object whose str() raises is named by its type."""
    try:
        text = " ".join(str(value).split())
    except BaseException:
        text = f"<{type(value).__name__} whose str() raised>"
    return text if len(text) <= limit else text[: limit - 3] + "..."
