"""Calling a user's code (tools, environments' steps) from an engine's event loop without handing
it the loop.

An async callable runs on the loop, as asyncio code must: it is trusted not to block. A sync
one runs in a thread of its own pool, so that a tool that sleeps, reads a socket or spins
holds only the trajectory that called it, never the engine's generation, its weight loads or
the other trajectories; the caller's `asyncio.wait_for` then bounds it like an async call. A
thread cannot be stopped: a sync call past its deadline runs on to its end in the background
(its result is dropped), and while every thread is held by such calls new ones wait for a
free thread, still within their own deadlines. The pool is its own, not the loop's default
executor, which the engine's actor uses for its weight intake, nor the built-in tools' (the
calculator's: `BUILTIN_CALLS`), so that hung users' tools never starve them. An async call that
blocks the loop anyway is timed, counted and warned about (rollout/loop_watch.py). (Loading that
code from its `module:name` is groupflow/core/user_code.py's.)

Whatever the code raises comes out as one error, `UserCodeFailed`, which a trajectory or a tool
call handles like any other: SystemExit (a tool built on argparse or click, an environment
calling sys.exit), KeyboardInterrupt, a CancelledError nobody asked for, an exception whose
str() raises. Only a cancellation of the caller itself (its deadline, the engine stopping it)
goes through as one. An async call runs in a task of its own, so that code which cancels its
own task cancels only itself; and since a task re-raises SystemExit and KeyboardInterrupt out
of the event loop, that task hands them back as values.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from groupflow.core.user_code import raised_text
from groupflow.rollout.loop_watch import LoopWatch

THREADS = 8  # sync calls of users' code running at once in an engine's process
BUILTIN_THREADS = 4  # the built-in tools' own


class UserCodeFailed(Exception):
    """What a user's code raised, whatever it was (`raised`); its message is raised_text's."""

    def __init__(self, raised: BaseException):
        super().__init__(raised_text(raised))
        self.raised = raised


class UserCalls:
    def __init__(self, threads: int, name: str, watch: LoopWatch):
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
        self.watch = watch

    async def call(self, fn: Callable[..., Any], *args: Any, culprit: str | None = None) -> Any:
        """fn(*args), awaited if it returns an awaitable; UserCodeFailed if it raises.
        `culprit` names the code where it blocks the loop (default: fn's own name)."""
        try:
            if is_async(fn):
                result = fn(*args)
            else:
                result = await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
            if inspect.isawaitable(result):
                timed = self.watch.timed(result, culprit or code_name(fn))
                result, raised = await asyncio.ensure_future(_settled(timed))
                if raised is not None:
                    raise raised
            return result
        except asyncio.CancelledError as err:
            if asyncio.current_task().cancelling():
                raise  # the caller's own: its deadline, or the engine stopping it
            raise UserCodeFailed(err) from err
        except BaseException as err:
            raise UserCodeFailed(err) from err


def user_attribute(obj: object, name: str) -> Any:
    """obj.name; UserCodeFailed whatever looking it up raises (a property, a __getattr__)."""
    try:
        return getattr(obj, name)
    except BaseException as err:  # synchronous: no cancellation of ours reaches it
        raise UserCodeFailed(err) from err


async def _settled(awaitable) -> tuple[Any, BaseException | None]:
    """(result, None) or (None, what it raised), in the task that awaits it; a cancellation
    stays one, so that the task ends cancelled."""
    try:
        return await awaitable, None
    except asyncio.CancelledError:
        raise
    except BaseException as err:  # a task would re-raise SystemExit out of the event loop
        return None, err


def code_name(fn: Callable[..., Any]) -> str:
    """`module.qualname` of a function, a method or a callable object (its class's)."""
    named = fn if hasattr(fn, "__qualname__") else type(fn)
    return f"{getattr(named, '__module__', '?')}.{getattr(named, '__qualname__', '?')}"


def is_async(fn: Callable[..., Any]) -> bool:
    """A coroutine function, or an object whose __call__ is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


# One engine per process: one watch and one pool of each per process.
LOOP_WATCH = LoopWatch()
USER_CALLS = UserCalls(THREADS, "user-code", LOOP_WATCH)
BUILTIN_CALLS = UserCalls(BUILTIN_THREADS, "builtin-tool", LOOP_WATCH)
