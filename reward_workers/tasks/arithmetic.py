"""The quickstart task: integer arithmetic such as `37+45=`, answered with the number."""

from __future__ import annotations

import random
import re
from typing import Any

from groupflow.records import Prompt, Verdict
from groupflow.reward_workers.tasks.base import GeneratedTask

_LEADING_INT = re.compile(r"\s*(-?\d{1,40})(?!\d)")


class ArithmeticTask(GeneratedTask):
    """Sums and differences of `terms` non-negative integers of up to `digits` digits."""

    name = "arithmetic"

    def __init__(self, digits: int = 1, terms: int = 3, ops: str = "+-"):
        if digits < 1 or terms < 2 or not ops or set(ops) - set("+-"):
            raise ValueError(
                f"arithmetic: need digits >= 1, terms >= 2, ops from '+-' (got {digits}, {terms}, {ops!r})"
            )
        self.digits, self.terms, self.ops = digits, terms, ops

    def _make(self, rng: random.Random) -> Prompt:
        hi = 10**self.digits - 1
        answer = rng.randint(0, hi)
        expr = str(answer)
        for _ in range(self.terms - 1):
            op, value = rng.choice(self.ops), rng.randint(0, hi)
            answer += value if op == "+" else -value
            expr += f"{op}{value}"
        return Prompt(uid=expr, text=f"{expr}=", answer=answer)

    def parse_answer(self, raw: Any) -> int:
        if type(raw) is not int:
            raise ValueError(f"expected an integer, got {type(raw).__name__}")
        return raw

    def verify(self, prompt: Prompt, response: str) -> Verdict:
        match = _LEADING_INT.match(response)
        if match is None:
            return Verdict(0.0, "no number at the start of the response")
        got = int(match.group(1))
        if got == prompt.answer:
            return Verdict(1.0, f"correct: {got}")
        return Verdict(0.0, f"wrong: {got} != {prompt.answer}")
