"""Scorer processes that can be killed: the deadline of every verifier and plugin call.

A pool of pre-started child processes (reward_workers/verifier_child.py), each with the task
or plugin loaded, serves calls one at a time and is reused while healthy. A call that runs
past its deadline (the verifier's own timeout plus a margin) gets a timeout verdict; its
process is killed with everything it started and a fresh one is started at once, so that
the next call finds it ready. Computation in C under the GIL (a sympy power tower, a
catastrophic regex) cannot outlive its deadline, however many calls time out.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import queue
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from groupflow.core.records import Prompt, Verdict
from groupflow.reward_workers.sandbox import parent_death_prefix, with_parent_death
from groupflow.reward_workers.verifier_child import read_exactly, write_frame

# What a call may take beyond its verifier's timeout: the pipe round trip and process noise.
DEADLINE_MARGIN_S = 0.5
# A fresh scorer process imports the task's libraries (sympy, math-verify: seconds).
STARTUP_TIMEOUT_S = 120.0
_MAX_VERDICT_BYTES = 1 << 16
_ERRORS = (None, "error", "timeout")


@dataclass(frozen=True)
class VerifierSpec:
    """What a scorer process loads: a built-in task's verifier, or a plugin instead."""

    task_name: str
    task_options: dict[str, Any] | None
    plugin: str | None
    sandbox_platform: Any = None  # the parent's probed SandboxPlatform, to skip probing again


class VerifierStartFailed(ValueError):
    pass


class _Process:
    def __init__(self, spec: VerifierSpec):
        request_r, self._request_w = os.pipe()
        self._verdict_r, verdict_w = os.pipe()
        command = [
            sys.executable,
            "-m",
            "groupflow.reward_workers.verifier_child",
            str(request_r),
            str(verdict_w),
        ]
        self.proc = subprocess.Popen(
            # Dies with the worker even while stuck in C code that never reads its pipe.
            with_parent_death(parent_death_prefix(), command),
            pass_fds=(request_r, verdict_w),
            stdin=subprocess.DEVNULL,
            stdout=sys.stderr.fileno() if _has_fileno(sys.stderr) else subprocess.DEVNULL,
            start_new_session=True,  # its sandboxes and helpers are killed with it
        )
        os.close(request_r)
        os.close(verdict_w)
        write_frame(self._request_w, pickle.dumps(spec))
        self.ready = False
        self.died = False

    def wait_ready(self) -> None:
        if self.ready:
            return
        reply = self._receive(STARTUP_TIMEOUT_S)
        if reply is None:
            self.kill()
            raise VerifierStartFailed("scorer process failed to start (see the log above)")
        message = json.loads(reply)
        if "setup_error" in message:
            self.kill()
            raise VerifierStartFailed(str(message["setup_error"]))
        self.ready = True

    def call(self, prompt: Prompt, response: str, deadline_s: float) -> Verdict | None:
        """The verdict, or None when the process died or ran past the deadline."""
        try:
            request = pickle.dumps((prompt, response))
        except (RecursionError, pickle.PicklingError, TypeError, ValueError) as err:
            # a prompt the parent cannot send (nested too deep): its verdict, not a restart
            return Verdict(0.0, f"the prompt cannot be sent to the scorer ({type(err).__name__})")
        try:
            write_frame(self._request_w, request)
        except OSError:
            self.died = True
            return None
        reply = self._receive(deadline_s)
        return None if reply is None else _parse_verdict(reply)

    def _receive(self, timeout_s: float) -> bytes | None:
        end = time.monotonic() + timeout_s
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self._verdict_r], [], [], left)
            if ready:
                break
        header = read_exactly(self._verdict_r, 4, end)
        if header is None:
            self.died = True  # readable but no frame: end of file
            return None
        size = int.from_bytes(header, "big")
        if size > _MAX_VERDICT_BYTES:
            return None
        return read_exactly(self._verdict_r, size, end)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        for fd in (self._request_w, self._verdict_r):
            try:
                os.close(fd)
            except OSError:
                pass


def _has_fileno(stream: Any) -> bool:
    try:
        stream.fileno()
        return True
    except (AttributeError, OSError, ValueError):
        return False


def _parse_verdict(payload: bytes) -> Verdict:
    """Validate what the child sent: a finite reward in [0, 1], a text reason, a known error."""
    try:
        fields = json.loads(payload)
        reward, reason, error = fields["reward"], fields["reason"], fields["error"]
    except (ValueError, KeyError, TypeError):
        return Verdict(0.0, "scorer process sent a malformed verdict", error="error")
    if (
        isinstance(reward, bool)
        or not isinstance(reward, int | float)
        or not math.isfinite(reward)
        or not 0.0 <= reward <= 1.0
        or not isinstance(reason, str)
        or error not in _ERRORS
    ):
        return Verdict(0.0, "scorer process sent an invalid verdict", error="error")
    return Verdict(float(reward), reason[:300], error)


class VerifierPool:
    """`size` scorer processes; verify() from up to `size` threads at once."""

    def __init__(self, spec: VerifierSpec, size: int, timeout_s: float):
        if size < 1:
            raise ValueError(f"scorer processes: need at least 1 (got {size})")
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"verifier timeout must be a positive number (got {timeout_s})")
        self.spec, self.timeout_s, self.size = spec, timeout_s, size
        self.restarts = 0
        self._idle: queue.Queue[_Process] = queue.Queue()
        # The parent-death signal fires when the *thread* that started a process ends, so
        # every scorer process is started from this one thread, which lives as long as the pool.
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verifier-spawn")
        started = [self._spawn() for _ in range(size)]
        try:
            for process in started:
                process.wait_ready()  # a plugin that fails to import: one line, at once
        except VerifierStartFailed:
            for process in started:
                process.kill()
            self._spawner.shutdown()
            raise
        for process in started:
            self._idle.put(process)
        self._executor = ThreadPoolExecutor(max_workers=size, thread_name_prefix="verifier")

    def verify(self, prompt: Prompt, response: str, deadline_s: float | None = None) -> Verdict:
        """One call, ended at min(timeout + margin, deadline_s) whatever the verifier does."""
        limit = self.timeout_s + DEADLINE_MARGIN_S
        if deadline_s is not None:
            limit = min(limit, deadline_s)
        process = self._idle.get()
        healthy = False
        try:
            try:
                process.wait_ready()
            except VerifierStartFailed as err:
                return Verdict(0.0, f"scorer process failed to start: {err}"[:300], "error")
            verdict = process.call(prompt, response, max(0.0, limit))
            if verdict is None:
                if process.died:
                    return Verdict(0.0, "scorer process died", error="error")
                return Verdict(0.0, f"no verdict within {limit:g} s", error="timeout")
            healthy = True
            return verdict
        finally:
            if not healthy:
                process.kill()
                process = self._spawn()
                self.restarts += 1
            self._idle.put(process)

    def _spawn(self) -> _Process:
        return self._spawner.submit(_Process, self.spec).result()

    def verify_all(
        self, items: Iterable[tuple[Prompt, str]], budget_s: float | None = None
    ) -> Iterator[Verdict]:
        """Verdicts in order, `size` at a time; with a budget, calls still unstarted when it
        runs out are timeouts too, so the whole batch ends within budget_s (plus a margin)."""
        end = None if budget_s is None else time.monotonic() + budget_s

        def one(item: tuple[Prompt, str]) -> Verdict:
            if end is None:
                return self.verify(*item)
            left = end - time.monotonic()
            if left <= 0:
                return Verdict(0.0, f"batch budget of {budget_s:g} s used up", error="timeout")
            return self.verify(*item, deadline_s=left)

        return self._executor.map(one, items)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        while not self._idle.empty():
            self._idle.get().kill()
        self._spawner.shutdown()
