"""What an environment answers a model's turn with (`Observation`), and the check of that
answer where it comes back from users' code.

An environment's step returns an Observation, a list of `{"role", "content"}` messages, or
None (or no messages) to end the trajectory. Whatever else it returns, or whatever of it has
the wrong type, is refused here with `InvalidObservation` naming the field (`tool_uses[0]`,
`messages[1]['content']`), which ends that trajectory as an environment error: nothing of an
unchecked answer goes on to the template, the tokenizer or the step's figures. What passes is
copied into plain objects, so that nothing the environment keeps can change it afterwards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from groupflow.core.records import TOOL_OUTCOMES, ToolUse
from groupflow.core.user_code import raised_text


@dataclass
class Observation:
    """An environment's answer to a turn: messages to insert (`{"role", "content"}`), and the
    tool calls it made for them."""

    messages: list[dict]
    tool_uses: list[ToolUse] = field(default_factory=list)


class InvalidObservation(ValueError):
    """An environment's answer that is not one: one line naming what is wrong with it."""


def checked_observation(reply: object) -> Observation | None:
    """`reply` as a fresh Observation, or None where it ends the trajectory;
    InvalidObservation otherwise. Reading users' objects runs their code (a property, a dict
    subclass): whatever that raises is the environment's error too."""
    try:
        return _checked(reply)
    except InvalidObservation:
        raise
    except BaseException as err:  # users' code, run synchronously: no cancellation of ours
        raise InvalidObservation(f"step's answer cannot be read: {raised_text(err)}") from None


def _checked(reply: object) -> Observation | None:
    if reply is None:
        return None
    if isinstance(reply, list):
        return Observation(_messages(reply, "step's messages")) if reply else None
    if not isinstance(reply, Observation):
        raise InvalidObservation(
            f"step returned {type(reply).__name__}: expected an Observation, a list of "
            "{'role', 'content'} messages or None"
        )
    messages = _messages(reply.messages, "Observation.messages")
    uses = reply.tool_uses
    if not isinstance(uses, list):
        raise InvalidObservation(
            f"Observation.tool_uses is {type(uses).__name__}: expected a list of ToolUse"
        )
    return Observation(
        messages, [_tool_use(u, f"Observation.tool_uses[{i}]") for i, u in enumerate(uses)]
    )


def _messages(messages: object, name: str) -> list[dict]:
    if not isinstance(messages, list):
        raise InvalidObservation(
            f"{name} is {type(messages).__name__}: expected a list of {{'role', 'content'}} messages"
        )
    checked = []
    for i, message in enumerate(messages):
        where = f"{name}[{i}]"
        if not isinstance(message, dict):
            raise InvalidObservation(
                f"{where} is {type(message).__name__}: expected a {{'role', 'content'}} dict"
            )
        copy = dict(message)
        for key in ("role", "content"):
            value = copy.get(key)
            if not isinstance(value, str):
                raise InvalidObservation(
                    f"{where}[{key!r}] is {type(value).__name__}: expected a string"
                )
            copy[key] = str.__str__(value)  # a plain str: no method of a subclass runs later
        checked.append(copy)
    return checked


def _tool_use(use: object, where: str) -> ToolUse:
    if not isinstance(use, ToolUse):
        raise InvalidObservation(f"{where} is {type(use).__name__}: expected a ToolUse")
    tool, outcome, seconds = use.tool, use.outcome, use.seconds
    if not isinstance(tool, str):
        raise InvalidObservation(f"{where}.tool is {type(tool).__name__}: expected a string")
    if not isinstance(outcome, str) or outcome not in TOOL_OUTCOMES:
        raise InvalidObservation(
            f"{where}.outcome is {_shown(outcome)}: expected one of {', '.join(TOOL_OUTCOMES)}"
        )
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise InvalidObservation(f"{where}.seconds is {type(seconds).__name__}: expected a number")
    if not (math.isfinite(seconds) and seconds >= 0):
        raise InvalidObservation(f"{where}.seconds is {seconds}: expected a finite number >= 0")
    return ToolUse(str.__str__(tool), str.__str__(outcome), float(seconds))


def _shown(value: object) -> str:
    return repr(str.__str__(value))[:60] if isinstance(value, str) else type(value).__name__
