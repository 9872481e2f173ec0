"""Final-answer extraction from a math solution, and equivalence via the math-verify library.

math-verify's own timeouts use signal.alarm, which works only in the main thread and cancels
any alarm the host process set. They are off: the check runs in a scorer process that is
killed at its deadline (reward_workers/verifier_pool.py). Answers that could make sympy run
away (towers of powers, huge exponents or factorials, long or deeply nested input) are still
refused up front, so that they cost a refusal instead of a timeout and a process restart.

Extraction looks only at the last MAX_EXTRACTION_CHARS of a response (where a final answer
is) and runs in linear time: no regex or scan restarts at every candidate.
"""

from __future__ import annotations

import functools
import logging
import re

import sympy
from math_verify import parse, verify

MAX_EXTRACTION_CHARS = 20_000
MAX_ANSWER_CHARS = 200
MAX_NESTING = 16
MAX_EXPONENT = 1000
MAX_FACTORIAL = 1000

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_ANSWER_IS = re.compile(r"(?:final answer|the answer)\s*(?:is|:)\s*:?\s*(.+)", re.IGNORECASE)
_TOKEN = re.compile(r"[^\s$]+")
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")
_FACTORIAL_LIKE = {"factorial", "factorial2", "subfactorial", "gamma", "binomial"}


class AnswerTooCostly(ValueError):
    pass


class _HideDisabledTimeoutWarning(logging.Filter):
    """math-verify warns that with its timeouts off nothing stops a runaway check; ours does."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_HideDisabledTimeoutWarning())


def last_boxed(text: str) -> str | None:
    """Content of the last well-formed \\boxed{...} (nested braces allowed) or \\boxed 5."""
    text = text[-MAX_EXTRACTION_CHARS:]
    closing = _matching_braces(text)
    for match in reversed(list(_BOXED.finditer(text))):
        start = match.end()
        if text.startswith("{", start):
            end = closing.get(start)
            if end is not None:
                return text[start + 1 : end].strip()
        else:
            token = _TOKEN.match(text, start)
            if token:
                return token.group(0)
    return None


def _matching_braces(text: str) -> dict[int, int]:
    """Position of each '{' -> position of its '}', in one pass (unclosed ones are absent)."""
    pairs, open_at = {}, []
    for i, ch in enumerate(text):
        if ch == "{":
            open_at.append(i)
        elif ch == "}" and open_at:
            pairs[open_at.pop()] = i
    return pairs


def extract_answer(response: str) -> tuple[str, str] | None:
    """(answer text, how it was found): the last \\boxed{}, else 'the answer is ...', else
    the last number in the response (its last MAX_EXTRACTION_CHARS)."""
    response = response[-MAX_EXTRACTION_CHARS:]
    boxed = last_boxed(response)
    if boxed:
        return boxed, "boxed"
    stated = _ANSWER_IS.findall(response)
    if stated:
        answer = stated[-1].strip().strip("*").rstrip(".").strip().strip("$").strip()
        if answer:
            return answer, "stated"
    numbers = _NUMBER.findall(response)
    if numbers:
        return numbers[-1].replace(",", ""), "last number"
    return None


def equivalent(gold: str, candidate: str) -> bool:
    """Whether the candidate answer equals the gold one, per math-verify.

    Raises AnswerTooCostly for answers refused up front."""
    _check_shape(candidate)
    return _compare(gold, candidate)


def _check_shape(candidate: str) -> None:
    if len(candidate) > MAX_ANSWER_CHARS:
        raise AnswerTooCostly(f"answer longer than {MAX_ANSWER_CHARS} characters")
    depth = deepest = 0
    for ch in candidate:
        depth += 1 if ch in "{([" else -1 if ch in "})]" else 0
        deepest = max(deepest, depth)
    if deepest > MAX_NESTING:
        raise AnswerTooCostly(f"answer nested deeper than {MAX_NESTING}")


def _compare(gold: str, candidate: str) -> bool:
    parsed = _parse(candidate)
    for expr in parsed:
        _check_cost(expr)
    return verify(_parse(gold), parsed, timeout_seconds=None)


@functools.lru_cache(maxsize=4096)
def _parse(answer: str) -> list:
    # Wrapping in $...$ makes math-verify read the text as LaTeX (plain numbers work too).
    return parse(f"${answer}$", parsing_timeout=None)


def _check_cost(expr: object) -> None:
    if not isinstance(expr, sympy.Basic):
        return
    nodes = list(sympy.preorder_traversal(expr))
    # Powers first: the factorial check below evaluates arguments, which must be tame by then.
    for node in nodes:
        if isinstance(node, sympy.Pow) and _is_huge_exponent(node.exp):
            raise AnswerTooCostly("exponent too large to check")
    for node in nodes:
        if type(node).__name__ in _FACTORIAL_LIKE and any(
            arg.is_number and bool(sympy.Abs(arg) > MAX_FACTORIAL) for arg in node.args
        ):
            raise AnswerTooCostly("factorial too large to check")


def _is_huge_exponent(exponent: sympy.Basic) -> bool:
    if exponent.is_Number:
        return abs(exponent) > MAX_EXPONENT
    # A numeric power inside an exponent (2^{3^{4}}, x^{10^{10}}) can be astronomically
    # large; roots there (2^{\sqrt{2}}) are harmless.
    return bool(exponent.is_number) and any(
        isinstance(inner, sympy.Pow) and not (inner.exp.is_Rational and abs(inner.exp) < 1)
        for inner in sympy.preorder_traversal(exponent)
    )
