"""The quickstart task: integer arithmetic such as `37+45=`, answered with the number."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from itertools import product
from typing import Any

from groupflow.core.records import Prompt, Verdict
from groupflow.reward_workers.tasks.base import GeneratedTask
from groupflow.reward_workers.tasks.options import check_int

_LEADING_INT = re.compile(r"\s*(-?)(\d+)")
# What after the integer makes it one of several values or not an integer: "82 or 83",
# "82 (or 83)", "82/83", "82-83", "82, 83", "82 to 83", "82?", "82ish", "82.5", "82,5".
_NOT_ONE_INTEGER = re.compile(
    r"[.,]\d|[ \t]*(?:\(?[ \t]*(?:or|and|to|/|,|;|\||±|\+/-|-|–|—)?[ \t]*\(?[ \t]*-?\d"
    r"|\?|\(?[ \t]*(?:or\b|ish\b|maybe\b|perhaps\b|probably\b|approx|roughly\b|about\b))",
    re.IGNORECASE,
)


class ArithmeticTask(GeneratedTask):
    """Sums and differences of `terms` non-negative integers of up to `digits` digits."""

    name = "arithmetic"

    def __init__(self, digits: int = 1, terms: int = 3, ops: str = "+-"):
        check_int(self.name, "digits", digits, 1, 100)
        check_int(self.name, "terms", terms, 2, 1000)
        if not isinstance(ops, str) or not ops or set(ops) - set("+-"):
            raise ValueError(f"arithmetic: ops must be made of '+-' (got {ops!r})")
        self.digits, self.terms, self.ops = digits, terms, ops

    def _make(self, rng: random.Random) -> Prompt:
        hi = 10**self.digits - 1
        answer = rng.randint(0, hi)
        expr = str(answer)
        for _ in range(self.terms - 1):
            op, value = rng.choice(self.ops), rng.randint(0, hi)
            answer += value if op == "+" else -value
            expr += f"{op}{value}"
        # The raw prompt is the quickstart's completion format; a chat model gets an instruction
        # asking for what verify() reads: the integer, first.
        ask = f"Compute {expr}. Reply with the resulting integer only."
        return Prompt(
            uid=expr, text=f"{expr}=", answer=answer, messages=[{"role": "user", "content": ask}]
        )

    def _problem_uids(self, at_most: int) -> Iterator[str] | None:
        values, ops = [str(v) for v in range(10**self.digits)], sorted(set(self.ops))
        if len(values) ** self.terms * len(ops) ** (self.terms - 1) > at_most:
            return None
        return (
            first + "".join(op + value for op, value in zip(signs, rest, strict=True))
            for first, *rest in product(values, repeat=self.terms)
            for signs in product(ops, repeat=self.terms - 1)
        )

    def parse_answer(self, raw: Any) -> int:
        if type(raw) is not int:
            raise ValueError(f"expected an integer, got {type(raw).__name__}")
        return raw

    def verify(self, prompt: Prompt, response: str) -> Verdict:
        """The integer the response starts with, compared exactly; digits are never converted
        past the answer's length, so a huge number costs no more than a short one."""
        match = _LEADING_INT.match(response)
        if match is None:
            return Verdict(0.0, "no number at the start of the response")
        if _NOT_ONE_INTEGER.match(response, match.end()):
            return Verdict(0.0, f"not one integer: {response[: match.end() + 20].strip()!r}")
        sign, digits = match.groups()
        significant = digits.lstrip("0") or "0"
        if len(significant) > len(str(abs(prompt.answer))):
            return Verdict(0.0, f"wrong: a {len(significant)}-digit number")
        got = int(sign + significant)
        if got == prompt.answer:
            return Verdict(1.0, f"correct: {got}")
        return Verdict(0.0, f"wrong: {got} != {prompt.answer}")
