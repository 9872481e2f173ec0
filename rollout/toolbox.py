"""Tools a model calls inside a trajectory: what a tool is (`Tool`, declared to the chat
template by its JSON schema), reading calls out of a model's turn with vLLM's parsers, and
running a call within its deadline (`ToolBox`). Which tools a job has is rollout/tools.py's.

A call never raises into the trajectory: whatever goes wrong (a call that cannot be read, a
tool nobody declared, bad arguments, a tool that raises or overruns `timeout_s`) becomes a tool
message the model reads, and a `ToolUse` with its outcome, which the step's figures count.
A sync tool runs in a thread, an async one on the engine's event loop (rollout/user_calls.py),
so that it cannot hold the loop; the built-in tools' threads are not users' tools', so that
users' tools that hang never starve the calculator. Whatever a tool returns is made text in the
tool's own thread (a tool's result may be any object, and its str() any size or duration), and
cut to `output_chars` before it reaches the loop's rendering.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Protocol

from groupflow.core.errors import first_line
from groupflow.core.records import ToolUse
from groupflow.core.user_code import text_of
from groupflow.rollout.user_calls import BUILTIN_CALLS, USER_CALLS, UserCodeFailed


class ToolError(Exception):
    """A call the tool refuses (bad arguments, a failed computation): its message is what the
    model reads."""


class ToolWorkerLost(Exception):
    """The worker that ran a call was lost and no other ran it in time: the infrastructure's
    failure, not the model's (its trajectory ends, masked: groupflow/loop/infra_failures.py)."""


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
        # Many parsers look for their model's call markers in the tokenizer as they are built,
        # and raise where it lacks them (deepseek_v3, jamba, lfm2, mistral...): said here, in
        # one line naming the setting, where the driver vets the job before anything starts.
        self.tokenizer = tokenizer
        try:
            self._parser = parser_class(tokenizer)
            self.skip_special_tokens = self._parser.adjust_request(probe).skip_special_tokens
        except Exception as err:
            raise ValueError(
                f"agent.tool_parser: {name!r} cannot read this model's turns "
                f"({type(err).__name__}: {first_line(err, 200)}); choose the parser of the "
                "model's own tool-call format"
            ) from None
        # Where the parser's own start marker is in a turn it could not read, the model tried a
        # call: that is a malformed call, which the model is told about, not an answer.
        self._marker = getattr(parser_class, "tool_call_start_token", None)
        # vLLM logs a traceback for each call it cannot read; a model in training writes many,
        # and each one is counted and told to the model instead.
        logging.getLogger(parser_class.__module__).setLevel(logging.CRITICAL)

    def extract(self, text: str):
        """vLLM's reading of a turn (its content and tool calls, as vLLM's server answers)."""
        return self._parser.extract_tool_calls(text, self._request)

    def parse(self, text: str) -> ParsedTurn:
        try:
            found = self.extract(text)
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

    def __init__(
        self,
        tools: list[Tool],
        timeout_s: float,
        output_chars: int,
        builtin: frozenset[str] = frozenset(),
    ):
        self.tools = {t.name: t for t in tools}
        self.timeout_s = timeout_s
        self.output_chars = output_chars
        self.builtin = builtin  # the names of groupflow's own tools: their calls have own threads

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
            content = await asyncio.wait_for(self._text(tool, call), self.timeout_s)
        except (TimeoutError, UserCodeFailed) as err:
            raised = getattr(err, "raised", err)
            if isinstance(raised, TimeoutError):  # the deadline's, or the tool's own (python's)
                content = f"error: {call.name} ran past {self.timeout_s:g}s"
                return self._reply(call.name, "timeout", content, start)
            if isinstance(raised, ToolError):  # a refusal: its message is for the model
                return self._reply(call.name, "error", f"error: {text_of(raised)}", start)
            if isinstance(raised, ToolWorkerLost):
                return self._reply(call.name, "lost", f"error: {text_of(raised)}", start)
            return self._reply(call.name, "error", f"error: {err}", start)  # whatever it raised
        return self._reply(call.name, "ok", content, start)

    async def _text(self, tool: Tool, call: ToolCall) -> str:
        """The tool's result as text, at most output_chars and a few more."""
        calls = BUILTIN_CALLS if call.name in self.builtin else USER_CALLS
        result = await calls.call(tool, call.arguments, culprit=f"tool {call.name!r}")
        if type(result) is not str:  # str() of any object is users' code
            result = await calls.call(text_of, result)
        return result[: self.output_chars + 1]

    def _reply(self, name: str, outcome: str, content: str, start: float | None = None):
        if len(content) > self.output_chars:
            content = content[: self.output_chars] + " ...(cut)"
        seconds = 0.0 if start is None else time.monotonic() - start
        return ToolReply(content, ToolUse(name, outcome, seconds))
