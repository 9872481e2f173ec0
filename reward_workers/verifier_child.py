"""The scorer process: runs a task's verifier or a reward plugin on requests from its parent.

reward_workers/verifier_pool.py starts it as `python -m groupflow.reward_workers.verifier_child
<request fd> <verdict fd>` and kills it at any call's deadline, so that whatever can block
(sympy, math-verify, regexes, plugin code) never blocks the worker. Its stdout is the worker's
stderr: a plugin's own printing cannot reach the verdict channel (a pipe only this loop writes)
nor the CLI's output.

Frames on both pipes are a 4-byte big-endian length and a payload: the setup and requests are
pickles from the (trusted) parent; verdicts go back as small JSON objects that the parent
validates, so nothing this process produces is unpickled.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import select
import struct
import sys
import time
from typing import Any

from groupflow.core.records import Prompt, Verdict

_HEADER = struct.Struct(">I")


def read_frame(fd: int) -> bytes | None:
    header = read_exactly(fd, _HEADER.size)
    if header is None:
        return None
    return read_exactly(fd, _HEADER.unpack(header)[0])


def write_frame(fd: int, payload: bytes) -> None:
    data = _HEADER.pack(len(payload)) + payload
    while data:
        data = data[os.write(fd, data) :]


def read_exactly(fd: int, size: int, end: float | None = None) -> bytes | None:
    """`size` bytes from `fd`; None at end of file, or when `end` (time.monotonic()) passes
    first."""
    chunks, left = [], size
    while left:
        if end is not None and not select.select([fd], [], [], max(0.0, end - time.monotonic()))[0]:
            return None
        chunk = os.read(fd, left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def verdict_payload(verdict: Verdict) -> bytes:
    # ASCII JSON: lone surrogates in a reason travel as escapes instead of failing here.
    return json.dumps(
        {"reward": verdict.reward, "reason": verdict.reason, "error": verdict.error}
    ).encode()


class _Verifier:
    def __init__(self, setup: Any):  # a verifier_pool.VerifierSpec
        from groupflow.reward_workers import sandbox
        from groupflow.reward_workers.plugins import call_plugin, load_plugin
        from groupflow.reward_workers.tasks import make_task
        from groupflow.reward_workers.tasks.prompt_pool import POOL_OPTIONS

        if setup.sandbox_platform is not None:
            sandbox.use_platform(setup.sandbox_platform)
        options = {k: v for k, v in (setup.task_options or {}).items() if k not in POOL_OPTIONS}
        self.task = make_task(setup.task_name, options)
        self.plugin = load_plugin(setup.plugin) if setup.plugin else None
        self._call_plugin = call_plugin
        self._loop = asyncio.new_event_loop()  # one for the process: clients bound to it stay valid

    def verify(self, prompt: Prompt, response: str) -> Verdict:
        if self.plugin is not None:
            return self._call_plugin(self.plugin, prompt, response, self._loop)
        try:
            return self.task.verify(prompt, response)
        except BaseException as err:  # a verifier bug costs one sample, not the process
            return Verdict(0.0, _describe_error(f"{self.task.name} verifier", err), error="error")


def _describe_error(who: str, err: BaseException) -> str:
    try:
        text = f"{who} raised {type(err).__name__}: {err}"
    except BaseException:  # an exception whose str() raises
        text = f"{who} raised {type(err).__name__}"
    return " ".join(text.split())[:300]


def main(request_fd: int, verdict_fd: int) -> None:
    os.dup2(2, 1)  # print() from plugins and libraries goes to stderr, never to a channel
    sys.stdout = sys.stderr
    setup_frame = read_frame(request_fd)
    if setup_frame is None:
        return
    try:
        verifier = _Verifier(pickle.loads(setup_frame))
    except BaseException as err:  # import-time exits too: the parent reports them in one line
        message = err.args[0] if isinstance(err, ValueError) and err.args else None
        text = str(message) if message else _describe_error("setup", err)
        write_frame(verdict_fd, json.dumps({"setup_error": " ".join(text.split())}).encode())
        return
    write_frame(verdict_fd, b'{"ready": true}')
    while (frame := read_frame(request_fd)) is not None:
        prompt, response = pickle.loads(frame)
        try:
            payload = verdict_payload(verifier.verify(prompt, response))
        except BaseException as err:  # e.g. a reason that cannot be encoded
            payload = verdict_payload(Verdict(0.0, _describe_error("verifier", err), "error"))
        write_frame(verdict_fd, payload)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
