"""The built-in `python` tool: the model's code run as a program in the code verifier's sandbox
(docs/sandbox.md), by the program runner the engine is handed (`RunCode`: the tool pool's, or
one in this process for `groupflow eval`; both in actors/tools.py), so that model-written
code never runs in an engine's process. Returns what it printed, or the last line of its
error."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from groupflow.rollout.toolbox import ToolError

# What the python tool is handed by the layer that starts the engine (actors/): run code in a
# sandbox within a deadline and return (exit status, stdout, stderr, timed out).
RunCode = Callable[[str, float], Awaitable[tuple[int, str, str, bool]]]


class PythonTool:
    name = "python"
    description = "Run a Python program in a sandbox and return what it prints."
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "a complete program"}},
        "required": ["code"],
    }

    def __init__(self, run_code: RunCode | None, timeout_s: float):
        self.run_code = run_code
        self.timeout_s = timeout_s

    async def __call__(self, arguments: dict) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ToolError("code must be a string")
        if self.run_code is None:
            raise ToolError("no tool pool runs python here")
        status, stdout, stderr, timed_out = await self.run_code(code, self.timeout_s)
        if timed_out:
            raise TimeoutError
        if status != 0:
            tail = stderr.strip().splitlines()[-1:] or [f"exit status {status}"]
            raise ToolError(f"{stdout}{tail[0]}")
        return stdout
