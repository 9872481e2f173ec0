"""Tools a model calls inside a trajectory: their declarations (JSON schemas, handed to the chat
template), the built-in ones, reading calls out of a model's turn, and running a call within
its deadline.

A call never raises into the trajectory: whatever goes wrong (a call that cannot be read, a
tool nobody declared, bad arguments, a tool that raises or overruns `timeout_s`) becomes a tool
message the model reads, and a `ToolUse` with its outcome, which the step's figures count.

Built-in tools (`BUILTIN_TOOLS`):
- `calculator`: integer and decimal arithmetic, evaluated in-process from the expression's
  syntax tree with bounded operands (no `eval`, no power towers);
- `python`: runs the model's code in the sandbox of the code verifier (docs/sandbox.md), in a
  tool worker of the tool pool (actors/tools.py), and returns what it printed.
A user tool is `module:name` naming an object with `name`, `description`, `parameters` (a
JSON schema) and a call taking the arguments dict and returning text (sync or async); it runs
in the engine's process, like a reward plugin in a scorer's: an async one on the engine's event
loop, a sync one in a thread (rollout/user_code.py), so that it cannot hold the loop.
"""

from __future__ import annotations

import ast
import asyncio
import json
import logging
import math
import operator
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from groupflow.records import ToolUse
from groupflow.rollout.user_code import USER_CODE


class ToolError(Exception):
    """A call the tool refuses (bad arguments, a failed computation): its message is what the
    model reads."""


class Tool(Protocol):
    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object

    def __call__(self, arguments: dict) -> str | Awaitable[str]: ...


def tool_schema(tool: Tool) -> dict:
    """The declaration a chat template renders (the OpenAI function format)."""
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": tool.parameters,
        },
    }


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class ParsedTurn:
    """The calls in one model turn; `malformed` says why a call there could not be read."""

    calls: list[ToolCall]
    malformed: str | None = None


class ToolCallParser:
    """Tool calls out of a model's turn, by one of vLLM's tool parsers (`agent.tool_parser`:
    `hermes` reads Hermes/Qwen `<tool_call>{"name": ..., "arguments": ...}</tool_call>`)."""

    def __init__(self, name: str, tokenizer, schemas: list[dict]):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager

        known = ToolParserManager.list_registered()
        if name not in known:
            raise ValueError(f"agent.tool_parser: vLLM has no tool parser {name!r} ({known})")
        parser_class = ToolParserManager.get_tool_parser(name)
        self._parser = parser_class(tokenizer)
        self._request = ChatCompletionRequest(
            messages=[{"role": "user", "content": ""}], model="groupflow", tools=schemas or None
        )
        # Some models mark their call markers special (Hermes 2 Pro's <tool_call>), and a turn
        # decoded without special tokens would then never show a call: the parser says how
        # turns must be decoded, as vLLM's server asks it (adjust_request), tools or not.
        probe = ChatCompletionRequest(
            messages=[{"role": "user", "content": ""}],
            model="groupflow",
            tools=[{"type": "function", "function": {"name": "probe", "parameters": {}}}],
        )
        self.skip_special_tokens = self._parser.adjust_request(probe).skip_special_tokens
        # Where the parser's own start marker is in a turn it could not read, the model tried a
        # call: that is a malformed call, which the model is told about, not an answer.
        self._marker = getattr(parser_class, "tool_call_start_token", None)
        # vLLM logs a traceback for each call it cannot read; a model in training writes many,
        # and each one is counted and told to the model instead.
        logging.getLogger(parser_class.__module__).setLevel(logging.CRITICAL)

    def parse(self, text: str) -> ParsedTurn:
        try:
            found = self._parser.extract_tool_calls(text, self._request)
        except Exception as err:  # a parser fails on text it did not expect
            return ParsedTurn([], f"the tool call cannot be read ({type(err).__name__})")
        if not found.tools_called:
            if self._marker and self._marker in text:
                return ParsedTurn([], "the tool call is not valid JSON with a name and arguments")
            return ParsedTurn([])
        calls = []
        for call in found.tool_calls:
            try:
                arguments = json.loads(call.function.arguments or "{}")
            except ValueError:
                return ParsedTurn(calls, f"the arguments of {call.function.name!r} are not JSON")
            if not isinstance(arguments, dict):
                return ParsedTurn(calls, f"the arguments of {call.function.name!r} are no object")
            calls.append(ToolCall(str(call.function.name), arguments))
        return ParsedTurn(calls)


@dataclass(frozen=True)
class ToolReply:
    content: str  # what the model reads in the tool message
    use: ToolUse


class ToolBox:
    """The tools of a job by name, each call bounded by `timeout_s` and its reply by
    `output_chars`."""

    def __init__(self, tools: list[Tool], timeout_s: float, output_chars: int):
        self.tools = {t.name: t for t in tools}
        self.timeout_s = timeout_s
        self.output_chars = output_chars

    @property
    def schemas(self) -> list[dict]:
        return [tool_schema(t) for t in self.tools.values()]

    async def call(self, call: ToolCall) -> ToolReply:
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return self._reply(
                call.name, "unknown", f"error: no tool {call.name!r} (tools: {known})"
            )
        start = time.monotonic()
        try:
            result = await asyncio.wait_for(USER_CODE.call(tool, call.arguments), self.timeout_s)
            return self._reply(call.name, "ok", str(result), start)
        except TimeoutError:
            return self._reply(
                call.name, "timeout", f"error: {call.name} ran past {self.timeout_s:g}s", start
            )
        except ToolError as err:
            return self._reply(call.name, "error", f"error: {err}", start)
        except Exception as err:  # a tool is code of its own: whatever it raises is its error
            return self._reply(call.name, "error", f"error: {type(err).__name__}: {err}", start)

    def _reply(self, name: str, outcome: str, content: str, start: float | None = None):
        if len(content) > self.output_chars:
            content = content[: self.output_chars] + " ...(cut)"
        seconds = 0.0 if start is None else time.monotonic() - start
        return ToolReply(content, ToolUse(name, outcome, seconds))


# --- built-in tools ---------------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 1000
MAX_RESULT_BITS = 4096  # about 1233 decimal digits: no operand or result beyond this

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class Calculator:
    name = "calculator"
    description = "Evaluate an arithmetic expression (+ - * / // % ** and parentheses)."
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. 48213*9127"}},
        "required": ["expression"],
    }

    def __call__(self, arguments: dict) -> str:
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            raise ToolError("expression must be a string")
        if len(expression) > MAX_EXPRESSION_CHARS:
            raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
        try:
            tree = ast.parse(expression.strip(), mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            raise ToolError(f"cannot read {expression[:80]!r}") from None
        value = _evaluate(tree.body)
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
            value = int(value)
        return str(value)


def _evaluate(node: ast.AST):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except (OverflowError, ValueError) as err:
            raise ToolError(str(err)) from None
    raise ToolError(f"only numbers and + - * / // % ** are allowed (found {type(node).__name__})")


def _check_power(base, exponent) -> None:
    # Decided before computing: 9**9**9 would hold the engine's event loop for minutes.
    if isinstance(exponent, int) and isinstance(base, int) and exponent > 0:
        if max(1, abs(base).bit_length() - 1) * exponent > MAX_RESULT_BITS:
            raise ToolError("the power is too large")
    elif abs(exponent) > MAX_RESULT_BITS:
        raise ToolError("the exponent is too large")


def _bounded(value):
    if isinstance(value, int) and value.bit_length() > MAX_RESULT_BITS:
        raise ToolError("a number is too large")
    if isinstance(value, complex):
        raise ToolError("the result is not a real number")
    return value


# What the python tool needs from the actor layer: run code in a sandbox within a deadline
# and return (exit status, stdout, stderr, timed out). actors/tools.py gives the tool pool's.
RunCode = Callable[[str, float], Awaitable[tuple[int, str, str, bool]]]
SANDBOX_MEMORY_MB = 512
SANDBOX_OUTPUT_BYTES = 64 << 10


def run_in_sandbox(code: str, timeout_s: float) -> tuple[int, str, str, bool]:
    """`code` run as a program in the code verifier's sandbox (docs/sandbox.md): what a tool
    worker does with each call."""
    from groupflow.reward_workers.sandbox import Limits, run_python

    limits = Limits(
        wall_s=timeout_s,
        cpu_s=max(1, math.ceil(timeout_s)),
        memory_mb=SANDBOX_MEMORY_MB,
        output_bytes=SANDBOX_OUTPUT_BYTES,
    )
    result = run_python(code, limits)
    return result.returncode, result.stdout, result.stderr, result.timed_out


def require_sandbox(allow_weak: bool) -> None:
    """Refuse, in one line, a platform whose sandbox lacks its kernel layers unless allowed."""
    from groupflow.reward_workers.sandbox import default_platform, require_strong

    require_strong(default_platform(), allow_weak, "agent.tools python")


def in_process_run_code(allow_weak: bool) -> RunCode:
    """The python tool's programs started from this process, in its user-code threads: for
    `groupflow eval`, which has no tool pool."""
    require_sandbox(allow_weak)

    async def run(code: str, timeout_s: float) -> tuple[int, str, str, bool]:
        return await USER_CODE.call(run_in_sandbox, code, timeout_s)

    return run


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


BUILTIN_TOOLS = ("calculator", "python")


def make_tools(names: list[str], run_code: RunCode | None, timeout_s: float) -> list[Tool]:
    """The tools named in `agent.tools`: built-in names or `module:name` of a user tool.
    Without `run_code` (the driver, declaring them to the template) python cannot run."""
    from groupflow.reward_workers.plugins import load_object

    tools: list[Tool] = []
    for name in names:
        if name == "calculator":
            tools.append(Calculator())
        elif name == "python":
            tools.append(PythonTool(run_code, timeout_s))
        else:
            tool = load_object(name, "agent.tools")
            for attribute in ("name", "description", "parameters"):
                if not hasattr(tool, attribute):
                    raise ValueError(f"agent.tools: {name!r} has no {attribute!r}")
            if not callable(tool):
                raise ValueError(f"agent.tools: {name!r} is not callable")
            tools.append(tool)
    seen = [t.name for t in tools]
    if len(set(seen)) < len(seen):
        raise ValueError(f"agent.tools: two tools share a name ({seen})")
    return tools
