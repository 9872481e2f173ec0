"""User reward plugins: `module:function` or `path/to/file.py:function` (loaded by
groupflow/core/user_code.py).

The function takes (prompt_text, response_text, answer) and returns a reward in [0, 1], or
(reward, info) where info becomes the reason; it may be sync or async. It runs in a scorer
process (reward_workers/verifier_pool.py) that is killed at the call's deadline. Whatever it
does per sample (raises anything, KeyboardInterrupt and SystemExit included, returns something
that is not a finite number in [0, 1], or an object whose conversion raises), the sample gets
Verdict(0.0, reason, error="error") and nothing is raised to the caller.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from groupflow.core.records import Prompt, Verdict
from groupflow.core.user_code import UserCodeError, load_user_object, raised_text, short_text


@dataclass(frozen=True)
class RewardPlugin:
    function: Callable[..., Any]
    name: str


def load_plugin(spec: str) -> RewardPlugin:
    """Import the plugin named by spec; UserCodeError (one line) if it cannot be loaded."""
    function = load_user_object(spec, "reward plugin")
    if not callable(function):
        raise UserCodeError(
            f"reward plugin {spec!r}: {spec.rpartition(':')[2]!r} is not a function"
        )
    return RewardPlugin(function, name=spec.rpartition(":")[2])


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
        return Verdict(0.0, f"{plugin.name} raised {raised_text(err)}", "error")


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
        return Verdict(0.0, f"{name} returned a number float() refuses: {short_text(err)}", "error")
    if not math.isfinite(reward) or not 0.0 <= reward <= 1.0:
        return Verdict(0.0, f"{name} returned {reward}, outside [0, 1]", "error")
    reason = f"{name}: {short_text(info, 300)}" if info is not None else f"{name}: {reward:g}"
    return Verdict(reward, reason[:300])
