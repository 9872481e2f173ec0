"""Calling a user's code (tools, environments' steps) from an engine's event loop without handing
it the loop.

An async callable runs on the loop, as asyncio code must: it is trusted not to block. A sync
one runs in a thread of its own pool, so that a tool that sleeps, reads a socket or spins
holds only the trajectory that called it, never the engine's generation, its weight loads or
the other trajectories; the caller's `asyncio.wait_for` then bounds it like an async call. A
thread cannot be stopped: a sync call past its deadline runs on to its end in the background
(its result is dropped), and while every thread is held by such calls new ones wait for a
free thread, still within their own deadlines. The pool is its own, not the loop's default
executor, which the engine's actor uses for its weight intake. (Loading that code from its
`module:name` is groupflow/core/user_code.py's.)
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

THREADS = 8  # sync calls running at once in an engine's process


class UserCalls:
    def __init__(self, threads: int = THREADS):
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="user-code")

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args), awaited if it returns an awaitable."""
        if is_async(fn):
            result = fn(*args)
        else:
            result = await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        if inspect.isawaitable(result):
            result = await result
        return result


def is_async(fn: Callable[..., Any]) -> bool:
    """A coroutine function, or an object whose __call__ is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


USER_CALLS = UserCalls()  # one engine per process: one pool per process
