"""The built-in `calculator` tool: integer and decimal arithmetic, evaluated in the engine's
process from the expression's syntax tree with bounded operands (no `eval`, no power towers:
9**9**9 is refused before it is computed, not a stalled engine)."""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

from groupflow.rollout.toolbox import ToolError

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
