"""Countdown: reach a target from given numbers with + - * / and parentheses.

Each given number may be used at most once. The model's expression is parsed with `ast`
(never evaluated by Python): only integer literals, the four binary operators and
parentheses are accepted, with bounded length and depth, and arithmetic is exact (Fraction).
"""

from __future__ import annotations

import ast
import random
import re
from collections import Counter
from fractions import Fraction
from typing import Any

from groupflow.core.records import Prompt, Verdict
from groupflow.reward_workers.format_reward import (
    blend_format,
    check_format_weight,
    disguised_tag,
    last_tagged_block,
)
from groupflow.reward_workers.tasks.base import GeneratedTask
from groupflow.reward_workers.tasks.options import check_int

MAX_EXPRESSION_CHARS = 200
MAX_DEPTH = 24
MAX_LITERAL_DIGITS = 12
MAX_MAGNITUDE = 10**30  # bound on numerators/denominators of intermediate results

_OPERATORS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}
# What models write instead of the ASCII operators.
_UNICODE_OPERATORS = str.maketrans({"×": "*", "·": "*", "÷": "/", "−": "-", "–": "-"})
_INTEGER = re.compile(r"\s*\d+\s*")


class BadExpression(ValueError):
    pass


def evaluate(expression: str) -> tuple[Fraction, list[int]]:
    """Exact value of the expression and the integer literals it uses; BadExpression if it
    is not a plain arithmetic expression within the bounds."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise BadExpression(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise BadExpression("not a valid arithmetic expression") from None
    literals: list[int] = []
    value = _evaluate_node(tree.body, expression, literals, depth=0)
    return value, literals


def _evaluate_node(node: ast.AST, source: str, literals: list[int], depth: int) -> Fraction:
    if depth > MAX_DEPTH:
        raise BadExpression(f"expression nested deeper than {MAX_DEPTH}")
    if isinstance(node, ast.Constant) and type(node.value) is int:
        # Only plain decimal digits: no 0x10, 1_0 or 1e3 spellings of a number.
        text = ast.get_source_segment(source.strip(), node) or ""
        if not text.isascii() or not text.isdigit() or len(text) > MAX_LITERAL_DIGITS:
            raise BadExpression(f"not a plain number: {text[:20]!r}")
        literals.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left = _evaluate_node(node.left, source, literals, depth + 1)
        right = _evaluate_node(node.right, source, literals, depth + 1)
        if isinstance(node.op, ast.Div) and right == 0:
            raise BadExpression("division by zero")
        value = _OPERATORS[type(node.op)](left, right)
        if abs(value.numerator) > MAX_MAGNITUDE or value.denominator > MAX_MAGNITUDE:
            raise BadExpression("intermediate result too large")
        return value
    what = (
        type(node.op).__name__ if isinstance(node, ast.BinOp | ast.UnaryOp) else type(node).__name__
    )
    raise BadExpression(f"{what} is not allowed (only numbers, + - * / and parentheses)")


def extract_expression(response: str) -> str | None:
    """The expression in the last <answer> block, or else on the last non-empty line;
    a trailing '= result' is dropped."""
    block = last_tagged_block(response)
    if block is None:
        lines = [line for line in response.splitlines() if line.strip()]
        block = lines[-1] if lines else ""
    parts = [p for p in block.translate(_UNICODE_OPERATORS).split("=") if p.strip()]
    if len(parts) > 1:  # "expr = 24" or "24 = expr": keep the side that is not the result
        parts = [p for p in parts if not _INTEGER.fullmatch(p)]
    return parts[0].strip() if len(parts) == 1 else None


class CountdownTask(GeneratedTask):
    """`count` numbers from 1..max_number; a positive integer target up to max_target that
    an expression over all the numbers reaches."""

    name = "countdown"

    def __init__(
        self,
        count: int = 4,
        max_number: int = 100,
        max_target: int = 1000,
        format_weight: float = 0.0,
    ):
        check_int(self.name, "count", count, 2, 6)
        check_int(self.name, "max_number", max_number, 2, 10**6)
        check_int(self.name, "max_target", max_target, 1, 10**9)
        self.count, self.max_number, self.max_target = count, max_number, max_target
        self.format_weight = check_format_weight(self.name, format_weight)

    def _make(self, rng: random.Random) -> Prompt:
        while True:
            numbers = [rng.randint(1, self.max_number) for _ in range(self.count)]
            target = self._random_result(numbers, rng)
            if target is not None:
                break
        listed = ", ".join(map(str, numbers))
        text = (
            f"Using the numbers [{listed}], create an expression that equals {target}. "
            "You may use +, -, *, / and parentheses, and each number at most once. "
            "Give the expression in <answer> </answer> tags, for example "
            "<answer> (1 + 2) / 3 </answer>."
        )
        return Prompt(
            uid=f"{listed}->{target}", text=text, answer={"numbers": numbers, "target": target}
        )

    def _random_result(self, numbers: list[int], rng: random.Random) -> int | None:
        # Combine the numbers in a random order with random operators; keep positive integers.
        pool = [Fraction(n) for n in rng.sample(numbers, len(numbers))]
        while len(pool) > 1:
            a, b = pool.pop(), pool.pop()
            op = rng.choice(list(_OPERATORS))
            if op is ast.Div and b == 0:
                return None
            pool.append(_OPERATORS[op](a, b))
        value = pool[0]
        if value.denominator != 1 or not 1 <= value <= self.max_target:
            return None
        return int(value)

    def parse_answer(self, raw: Any) -> dict[str, Any]:
        if not isinstance(raw, dict) or set(raw) != {"numbers", "target"}:
            raise ValueError('expected {"numbers": [...], "target": ...}')
        numbers, target = raw["numbers"], raw["target"]
        if not isinstance(numbers, list) or not all(type(n) is int for n in numbers):
            raise ValueError("numbers must be a list of integers")
        if type(target) is not int:
            raise ValueError("target must be an integer")
        return {"numbers": numbers, "target": target}

    def verify(self, prompt: Prompt, response: str) -> Verdict:
        if refused := disguised_tag(response):
            return refused
        verdict = self._check(prompt.answer, response)
        well_formatted = last_tagged_block(response) is not None
        return blend_format(verdict, well_formatted, self.format_weight)

    def _check(self, answer: dict[str, Any], response: str) -> Verdict:
        expression = extract_expression(response)
        if expression is None:
            return Verdict(0.0, "no expression found")
        try:
            value, used = evaluate(expression)
        except BadExpression as err:
            return Verdict(0.0, f"malformed: {err}")
        overused = Counter(used) - Counter(answer["numbers"])
        if overused:
            return Verdict(
                0.0, f"uses numbers not given (or too often): {sorted(overused.elements())}"
            )
        if value != answer["target"]:
            return Verdict(0.0, f"wrong: {expression} = {value}, not {answer['target']}")
        return Verdict(1.0, f"correct: {expression} = {answer['target']}")
