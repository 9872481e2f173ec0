"""User reward plugins: `module:function` or `path/to/file.py:function`.

The function takes (prompt_text, response_text, answer) and returns a reward in [0, 1], or
(reward, info) where info becomes the reason; it may be sync or async. Whatever it does per
sample (raises, returns something that is not a finite number in [0, 1], or runs past the
timeout), the sample gets Verdict(0.0, reason, error="error" | "timeout"), the first failure
of each kind is logged, and nothing is raised to the caller.

Sync functions run in a helper thread with a deadline (reward_workers.deadline). Async ones
run on one long-lived event loop in its own thread (so clients they keep, bound to a loop,
stay valid) under asyncio.wait_for; a coroutine that blocks its loop is abandoned together
with the loop, and later calls get a fresh one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import importlib
import importlib.util
import inspect
import logging
import math
import numbers
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from groupflow.records import Prompt, Verdict
from groupflow.reward_workers.deadline import DeadlineExceeded, call_with_deadline
from groupflow.reward_workers.log_once import LogOnce

logger = logging.getLogger(__name__)

# An async plugin's loop gets this share of the timeout (at most 1 s) on top of it to deliver
# the cancellation; a loop that cannot is blocked by sync work and is abandoned.
_CANCEL_GRACE_SHARE, _CANCEL_GRACE_MAX_S = 0.1, 1.0


class RewardPlugin:
    def __init__(self, function: Callable[..., Any], name: str, timeout_s: float = 30.0):
        if timeout_s <= 0:
            raise ValueError(f"reward plugin: timeout must be positive (got {timeout_s})")
        self.function, self.name, self.timeout_s = function, name, timeout_s
        self.is_async = inspect.iscoroutinefunction(function)
        self._log = LogOnce(logger)
        self._loop: _LoopThread | None = None
        self._loop_lock = threading.Lock()  # a worker may score from several threads

    def __call__(self, prompt: Prompt, response: str) -> Verdict:
        args = (prompt.text, response, prompt.answer)
        try:
            if self.is_async:
                result = self._call_async(args)
            else:
                result = call_with_deadline(lambda: self.function(*args), self.timeout_s)
        except (DeadlineExceeded, TimeoutError):
            return self._failed(
                "timeout", f"{self.name} gave no reward within {self.timeout_s:g} s"
            )
        except (Exception, SystemExit) as err:
            return self._failed("error", f"{self.name} raised {type(err).__name__}: {_short(err)}")
        return self._to_verdict(result)

    def _call_async(self, args: tuple) -> Any:
        with self._loop_lock:
            if self._loop is None:
                self._loop = _LoopThread()
            loop = self._loop
        future = loop.submit(asyncio.wait_for(self.function(*args), self.timeout_s))
        try:
            grace = min(_CANCEL_GRACE_MAX_S, _CANCEL_GRACE_SHARE * self.timeout_s)
            return future.result(self.timeout_s + grace)
        except TimeoutError:
            if not future.done():
                # The coroutine blocks its loop (sync work inside async code): drop both.
                future.cancel()
                with self._loop_lock:
                    if self._loop is loop:
                        self._loop = None
            raise DeadlineExceeded(f"no result within {self.timeout_s:g} s") from None

    def _to_verdict(self, result: Any) -> Verdict:
        info = None
        if isinstance(result, tuple) and len(result) == 2:
            result, info = result
        # numbers.Real takes numpy scalars too (plugins often return np.float32)
        if isinstance(result, bool) or not isinstance(result, numbers.Real):
            return self._failed(
                "error", f"{self.name} returned {type(result).__name__}, not a number"
            )
        reward = float(result)
        if math.isnan(reward) or not 0.0 <= reward <= 1.0:
            return self._failed("error", f"{self.name} returned {reward}, outside [0, 1]")
        reason = f"{self.name}: {info}" if info is not None else f"{self.name}: {reward:g}"
        return Verdict(reward, _short(reason, 300))

    def _failed(self, kind: str, reason: str) -> Verdict:
        self._log.warning(kind, f"reward plugin {reason}")
        return Verdict(0.0, reason, error=kind)


class _LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(
            target=self.loop.run_forever, name="reward-plugin-loop", daemon=True
        ).start()

    def submit(self, coroutine: Any) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)


def load_plugin(spec: str, timeout_s: float = 30.0) -> RewardPlugin:
    """Import the plugin named by spec; ValueError (one line) if it cannot be loaded."""
    target, sep, attribute = spec.rpartition(":")
    if not sep or not target or not attribute:
        raise ValueError(
            f"reward plugin {spec!r}: expected 'module:function' or 'file.py:function'"
        )
    from_file = target.endswith(".py") or "/" in target
    if from_file and not Path(target).is_file():
        raise ValueError(f"reward plugin {spec!r}: no such file {target}")
    try:
        module = _load_file(Path(target)) if from_file else importlib.import_module(target)
    except Exception as err:  # the plugin's own import-time errors, whatever they are
        raise ValueError(
            f"reward plugin {spec!r}: import failed: {type(err).__name__}: {_short(err)}"
        ) from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ValueError(f"reward plugin {spec!r}: {target} has no function {attribute!r}")
    return RewardPlugin(function, name=attribute, timeout_s=timeout_s)


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
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
