"""The built-in tools' registry (rollout/tools.py): a job's tools built from their names, a new
built-in tool one registry line, users' tools by `module:name`."""

from __future__ import annotations

import asyncio

import pytest

from groupflow.core.user_code import UserCodeError
from groupflow.rollout.calculator_tool import Calculator
from groupflow.rollout.python_tool import PythonTool
from groupflow.rollout.toolbox import ToolBox, ToolCall, ToolError
from groupflow.rollout.tools import BUILTIN_TOOLS, ToolSetup, make_tools


def test_the_built_in_names_stay_those_the_config_accepts():
    assert tuple(BUILTIN_TOOLS) == ("calculator", "python")


def test_a_job_gets_each_built_in_tool_built_for_it():
    async def run_code(code, timeout_s):
        return 0, f"ran {code} within {timeout_s}", "", False

    calculator, python = make_tools(["calculator", "python"], run_code, 3.0)
    assert isinstance(calculator, Calculator) and isinstance(python, PythonTool)
    assert python.run_code is run_code and python.timeout_s == 3.0
    assert asyncio.run(python({"code": "print(1)"})) == "ran print(1) within 3.0"
    assert make_tools([], None, 1.0) == []


def test_python_declared_without_a_runner_refuses_to_run():
    (python,) = make_tools(["python"], None, 1.0)
    with pytest.raises(ToolError, match="no tool pool runs python here"):
        asyncio.run(python({"code": "print(1)"}))


class Echo:
    name = "echo"
    description = "Say the text back."
    parameters = {"type": "object", "properties": {"text": {"type": "string"}}}

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s

    def __call__(self, arguments: dict) -> str:
        return str(arguments.get("text"))


def test_a_new_built_in_tool_is_one_registry_line(monkeypatch):
    monkeypatch.setitem(BUILTIN_TOOLS, "echo", lambda setup: Echo(setup.timeout_s))
    (echo,) = make_tools(["echo"], None, 2.5)
    assert isinstance(echo, Echo) and echo.timeout_s == 2.5
    reply = asyncio.run(ToolBox([echo], 1.0, 100).call(ToolCall("echo", {"text": "hi"})))
    assert reply.content == "hi" and reply.use.outcome == "ok"


def test_every_registry_entry_builds_a_tool_of_its_own_name():
    setup = ToolSetup(run_code=None, timeout_s=1.0)
    for name, build in BUILTIN_TOOLS.items():
        tool = build(setup)
        assert tool.name == name and tool.description and tool.parameters["type"] == "object"
        assert callable(tool)


def test_users_tools_load_by_module_name(tmp_path):
    file = tmp_path / "my_tools.py"
    file.write_text(
        "class Echo:\n    name = 'echo'\n    description = 'd'\n    parameters = {}\n"
        "    def __call__(self, arguments):\n        return 'x'\nECHO = Echo()\n"
        "class Nameless:\n    description = 'd'\n    parameters = {}\n"
        "NAMELESS = Nameless()\nCALCULATOR = Echo()\nCALCULATOR.name = 'calculator'\n"
    )
    (echo,) = make_tools([f"{file}:ECHO"], None, 1.0)
    assert echo.name == "echo"
    with pytest.raises(UserCodeError, match=r"^agent.tools: '.*:NAMELESS' has no 'name'$"):
        make_tools([f"{file}:NAMELESS"], None, 1.0)
    with pytest.raises(UserCodeError, match="agent.tools: two tools share a name"):
        make_tools(["calculator", f"{file}:CALCULATOR"], None, 1.0)
