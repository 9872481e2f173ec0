"""The built-in tool task: products of long numbers, which a small model cannot compute in its
head but can get from the calculator tool and copy (docs/agents.md).

```
prompt:    4821*9127=
turn 1:    <tool_call>{"name":"calculator","arguments":{"expression":"4821*9127"}}</tool_call>
tool:      <tool_response>44001267</tool_response>
turn 2:    44001267
```

The built-in model's warm start teaches both ways to answer: the tool in `TOOL_SHARE` of the
demonstrations, the bare product (which the model can only guess) in the rest. Training then
has something to find: trajectories that call the tool are right, guesses are not, and the
tool-use rate and held-out accuracy rise together.
"""

from __future__ import annotations

import json
import random
from typing import Any

from groupflow.core.records import Prompt, Verdict
from groupflow.reward_workers.tasks.base import GeneratedTask, hash_position
from groupflow.reward_workers.tasks.options import check_int

TOOL_SHARE = 0.25  # of the warm start's demonstrations that call the tool
TURN_TOKENS = 96  # a turn's limit: a call of the calculator is about 85 characters
RESPONSE_START = "<tool_response>"
RESPONSE_END = "</tool_response>"
# The built-in model's chat template: the user turn as it is, each assistant turn closed by
# the end-of-text token, a tool result between response tags; no generation prompt (the model
# answers straight after), and the tool declarations are not rendered (the character-level
# model has 256 positions; it learns its one tool from the demonstrations).
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}{{ m.content }}{{ eos_token }}"
    "{%- elif m.role == 'tool' -%}" + RESPONSE_START + "{{ m.content }}" + RESPONSE_END + ""
    "{%- else -%}{{ m.content }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


class ToolArithmeticTask(GeneratedTask):
    """The product of two `digits`-digit numbers (leading digit never 0)."""

    name = "tool_arithmetic"
    TOOLS = ("calculator",)
    EXTRA_CHARACTERS = '<>{}":_'  # of tool calls and responses, for the built-in tokenizer
    CHAT_TEMPLATE = CHAT_TEMPLATE
    DEMONSTRATION_FORMAT = f"hermes calls, {RESPONSE_START}, tool share {TOOL_SHARE}"

    def __init__(self, digits: int = 4):
        check_int(self.name, "digits", digits, 2, 12)
        self.digits = digits

    def _make(self, rng: random.Random) -> Prompt:
        low, high = 10 ** (self.digits - 1), 10**self.digits - 1
        a, b = rng.randint(low, high), rng.randint(low, high)
        expression = f"{a}*{b}"
        return Prompt(
            uid=expression,
            text=f"{expression}=",
            answer=a * b,
            messages=[{"role": "user", "content": f"{expression}="}],
            max_tokens=TURN_TOKENS,
        )

    def parse_answer(self, raw: Any) -> int:
        if type(raw) is not int:
            raise ValueError(f"expected an integer, got {type(raw).__name__}")
        return raw

    def verify(self, prompt: Prompt, response: str) -> Verdict:
        """The model's final turn (what the scorer hands a verifier of a trajectory) is
        exactly the product. Nothing in it is cut at a marker: a `</tool_response>` the model
        writes itself is part of a wrong answer."""
        final = response.strip()
        if final == str(prompt.answer):
            return Verdict(1.0, f"correct: {final}")
        if not final:
            return Verdict(0.0, "no answer in the final turn")
        return Verdict(0.0, f"wrong: {final[:40]!r} != {prompt.answer}")

    def demonstration_turns(self, prompt: Prompt) -> list[tuple[str, bool]]:
        """The warm start's demonstration after the prompt, as (text, trained) pieces; "" stands
        for the end-of-text token. Whether it calls the tool is a hash of the prompt."""
        answer = str(prompt.answer)
        if hash_position(f"tool/{prompt.uid}") >= TOOL_SHARE:
            return [(answer, True), ("", True)]
        return [
            (tool_call_text(prompt.uid), True),
            ("", True),
            (f"{RESPONSE_START}{answer}{RESPONSE_END}", False),
            (answer, True),
            ("", True),
        ]


def tool_call_text(expression: str) -> str:
    """A Hermes call of the calculator, compact (every character costs a position)."""
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(call, separators=(',', ':'))}</tool_call>"
