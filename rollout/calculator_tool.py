"""The built-in `calculator` tool: integer and decimal arithmetic, evaluated in the engine's
process from the expression's syntax tree with bounded operands (no `eval`, no power towers:
9**9**9 is refused before it is computed, not a stalled engine).

Arithmetic is exact: every number is a fraction (0.1 is one tenth, read from its digits, not
the nearest binary float), so 0.1+0.2 is 0.3 and 1e999 is a number, not infinity. A result
that is a terminating decimal is shown with all its digits; any other (1/3) correctly rounded
to SIGNIFICANT_DIGITS. Only a power with a fractional exponent (2**0.5) leaves the fractions:
it is a float, shown to FLOAT_DIGITS, and an infinite or undefined one is refused.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from decimal import Decimal, localcontext
from fractions import Fraction
from typing import Any

from groupflow.rollout.toolbox import ToolError

MAX_EXPRESSION_CHARS = 1000
MAX_RESULT_BITS = 4096  # about 1233 decimal digits: no operand or result beyond this
SIGNIFICANT_DIGITS = 20  # of a result whose decimal does not end (1/3)
FLOAT_DIGITS = 15  # of a power with a fractional exponent: what a double holds for certain

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
        text = expression.strip()
        try:
            tree = ast.parse(text, mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            raise ToolError(f"cannot read {expression[:80]!r}") from None
        return _shown(_evaluate(tree.body, text))


def _evaluate(node: ast.AST, text: str) -> Fraction | float:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return _bounded(node.value)
    if isinstance(node, ast.Constant) and type(node.value) is float:
        return _decimal_literal(ast.get_source_segment(text, node))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand, text))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left, text), _evaluate(node.right, text)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("a number is too large") from None
        except ValueError as err:
            raise ToolError(str(err)) from None
    raise ToolError(f"only numbers and + - * / // % ** are allowed (found {type(node).__name__})")


def _decimal_literal(literal: str) -> Fraction:
    """A decimal literal (0.1, 1e-5, 1_000.5) exactly, from its own digits: the float Python
    read is binary, and 1e999 infinite. Its exponent is checked before 10**exponent is."""
    value = Decimal(literal)
    if abs(value.adjusted()) > MAX_RESULT_BITS * math.log10(2):
        raise ToolError("a number is too large or too small")
    return _bounded(Fraction(value))


def _check_power(base: Fraction | float, exponent: Fraction | float) -> None:
    # Decided before computing: 9**9**9 would hold the engine's event loop for minutes.
    if isinstance(base, Fraction) and isinstance(exponent, Fraction) and exponent.denominator == 1:
        bits = max(base.numerator.bit_length(), base.denominator.bit_length())
        if max(1, bits - 1) * abs(exponent.numerator) > MAX_RESULT_BITS:
            raise ToolError("the power is too large")
    elif abs(exponent) > MAX_RESULT_BITS:
        raise ToolError("the exponent is too large")


def _bounded(value: Any) -> Fraction | float:
    if isinstance(value, complex):
        raise ToolError("the result is not a real number")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ToolError("the result is not a finite number")
        return value
    value = Fraction(value)  # `//` gives an int
    if max(value.numerator.bit_length(), value.denominator.bit_length()) > MAX_RESULT_BITS:
        raise ToolError("a number is too large")
    return value


def _shown(value: Fraction | float) -> str:
    """The result as a decimal: exact where it ends, else correctly rounded."""
    if isinstance(value, float):
        return f"{value:.{FLOAT_DIGITS}g}"
    if value.denominator == 1:
        return str(value.numerator)
    twos, fives = _multiplicity(value.denominator, 2), _multiplicity(value.denominator, 5)
    digits = SIGNIFICANT_DIGITS
    if value.denominator == 2**twos * 5**fives:  # a terminating decimal: all its digits
        places = max(twos, fives)
        digits = len(str(abs(value.numerator) * 10**places // value.denominator)) + 1
    with localcontext(prec=digits):
        return format(Decimal(value.numerator) / Decimal(value.denominator), "f")


def _multiplicity(n: int, prime: int) -> int:
    count = 0
    while n % prime == 0:
        n //= prime
        count += 1
    return count
