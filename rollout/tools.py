"""The tools of a job (`agent.tools`): built-in ones by name, from the registry below, and
users' own by `module:name` (docs/agents.md).

A built-in tool is a class in a module of its own (rollout/calculator_tool.py is the one to
copy: `name`, `description`, `parameters` as a JSON schema, and a call taking the arguments
dict and returning text, sync or async, raising `ToolError` with what the model should read)
and one line in `BUILTIN_TOOLS`, which builds it from the job's `ToolSetup`. The config
accepts the registry's names.

A user tool is `module:name` or `file.py:name` naming such an object; it runs in the engine's
process, like a reward plugin in a scorer's: an async one on the engine's event loop, a sync
one in a thread (rollout/user_calls.py), so that it cannot hold the loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from groupflow.core.user_code import UserCodeError, load_user_object
from groupflow.rollout.calculator_tool import Calculator
from groupflow.rollout.python_tool import PythonTool, RunCode
from groupflow.rollout.toolbox import Tool


@dataclass(frozen=True)
class ToolSetup:
    """What a built-in tool may take from the job."""

    run_code: RunCode | None  # runs the python tool's programs; None: declared, never run
    timeout_s: float  # agent.tool_timeout_s


# name -> the tool, built for a job
BUILTIN_TOOLS: dict[str, Callable[[ToolSetup], Tool]] = {
    "calculator": lambda setup: Calculator(),
    "python": lambda setup: PythonTool(setup.run_code, setup.timeout_s),
}


def make_tools(names: list[str], run_code: RunCode | None, timeout_s: float) -> list[Tool]:
    """The tools named in `agent.tools`: built-in names or `module:name` of a user tool.
    Without `run_code` (the driver, declaring them to the template) python cannot run."""
    setup = ToolSetup(run_code, timeout_s)
    tools = [BUILTIN_TOOLS[n](setup) if n in BUILTIN_TOOLS else _user_tool(n) for n in names]
    seen = [t.name for t in tools]
    if len(set(seen)) < len(seen):
        raise UserCodeError(f"agent.tools: two tools share a name ({seen})")
    return tools


def _user_tool(spec: str) -> Tool:
    tool = load_user_object(spec, "agent.tools")
    for attribute in ("name", "description", "parameters"):
        if not hasattr(tool, attribute):
            raise UserCodeError(f"agent.tools: {spec!r} has no {attribute!r}")
    if not callable(tool):
        raise UserCodeError(f"agent.tools: {spec!r} is not callable")
    return tool
