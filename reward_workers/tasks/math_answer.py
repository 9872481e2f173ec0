"""Final-answer extraction from a math solution, and equivalence via the math-verify library.

math-verify's own timeouts use signal.alarm, which works only in the main thread and cancels
any alarm the host process set. They are off: the check runs in a scorer process that is
killed at its deadline (reward_workers/verifier_pool.py). Answers that could make sympy run
away (towers of powers, huge exponents or factorials, long or deeply nested input) are still
refused up front, so that they cost a refusal instead of a timeout and a process restart.

Extraction looks only at the last MAX_EXTRACTION_CHARS of a response (where a final answer
is) and runs in linear time: no regex or scan restarts at every candidate.

The answer rules (docs/verifiers.md): a final answer is ONE value. A hedge (`6 \\lor 7`,
"3 (or 4)", `6 \\approx 7`, `x \\le 6`, `6 \\pm 1`, "maybe 6") or a list where the gold answer
is a single value is refused, unless the gold answer itself is written that way. An integer
or fraction gold answer is matched exactly (as rationals, never through a float); a decimal
or irrational one to a relative tolerance of REL_TOL.
"""

from __future__ import annotations

import cmath
import collections
import functools
import itertools
import logging
import re
from collections.abc import Iterator

import sympy
from math_verify import parse, verify

from groupflow.reward_workers.tasks.time_budget import BudgetSpent, within

MAX_EXTRACTION_CHARS = 20_000
MAX_ANSWER_CHARS = 200
MAX_NESTING = 16
MAX_EXPONENT = 1000
MAX_FACTORIAL = 1000
# Decimal or irrational gold answers: |answer - gold| <= REL_TOL * |gold| (ABS_TOL at zero).
# Nine significant digits: a full-precision float passes, a rounded approximation does not.
REL_TOL = 1e-9
ABS_TOL = 1e-12
_EXACT_REL_TOL, _EXACT_ABS_TOL = sympy.Rational(str(REL_TOL)), sympy.Rational(str(ABS_TOL))
# Inside tuples, sets and intervals math-verify compares floats rounded to this many decimals.
FLOAT_DECIMALS = 9
# Plain integers and decimals this long are compared digit by digit; Python refuses to
# convert longer digit strings (sys.int_max_str_digits) and nothing needs them.
MAX_LITERAL_DIGITS = 4000

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_ANSWER_IS = re.compile(r"(?:final answer|the answer)\s*(?:is|:)\s*:?\s*(.+)", re.IGNORECASE)
_TOKEN = re.compile(r"[^\s$]+")
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")
_FACTORIAL_LIKE = {"factorial", "factorial2", "subfactorial", "gamma", "binomial"}


class AnswerTooCostly(ValueError):
    pass


# Gold answers whose parse alone ran past a comparison's budget, and how often: after
# GOLD_PARSE_TRIES such parses (the first parse of a process also loads the LaTeX grammar) a
# gold is not parsed again in this process, since every response to its prompt would spend
# the budget on it; it is matched as its text only.
_GOLDS_PAST_BUDGET: collections.Counter[str] = collections.Counter()
GOLD_PARSE_TRIES = 2
_GOLD_PAST_BUDGET = "the gold answer takes too long to parse: matched as its text only"


class AnswerRefused(ValueError):
    """Not one value: a hedge, a relation other than `=`, or several candidate answers."""


# Ways of naming more than one value (or an approximate one). A label is refused in an answer
# only when the gold answer does not use it (`x \le 3` may be the gold answer).
_HEDGES = {
    "a disjunction": re.compile(r"\b(?:or|either)\b|\\(?:lor|vee)(?![a-zA-Z])|∨", re.I),
    "an approximation": re.compile(
        r"\\(?:approx|simeq|sim|thickapprox|cong|doteq)(?![a-zA-Z])|[≈∼≃≅]"
        r"|\b(?:approx(?:imately)?|about|around|roughly|nearly|almost)\b",
        re.I,
    ),
    "an inequality": re.compile(
        r"\\(?:le|leq|ge|geq|lt|gt|ne|neq|leqslant|geqslant|lesssim|gtrsim|nless|ngtr)"
        r"(?![a-zA-Z])|[<>≤≥≠]|!=",
    ),
    "plus-or-minus": re.compile(r"\\(?:pm|mp)(?![a-zA-Z])|[±∓]"),
    "a guess": re.compile(
        r"\b(?:maybe|perhaps|possibly|probably|likely|alternatively|otherwise|unsure)\b", re.I
    ),
    "an alternative in parentheses": re.compile(r"\d\s*\(\s*[-+]?\d[\d.,]*\s*\)"),
    # `x = 6 = 7`; not `x = 1, x = 2` or `x = 1 \lor x = 2` (judged as lists, disjunctions)
    "a chain of equalities": re.compile(r"=(?:(?!\\lor|\\vee|\bor\b)[^=,;])*="),
}
# Hedge forms that a gold answer of another form makes legitimate: a gold interval may be
# answered as an inequality (`(-\infty, 3]` as `x \le 3`), several gold values as a
# disjunction (`1, 2` as `x = 1 \text{ or } x = 2`; 1,000 is one value).
_ALLOWED_BY_GOLD = {
    "an inequality": re.compile(r"\\infty|\\cup|^\s*[\[(][^,]*,[^,]*[\])]\s*$"),
    "a disjunction": re.compile(r"(?<!\d),|,(?!\d{3}(?!\d))|;"),
}
_NEVER = re.compile(r"(?!)")
_OR_SYMBOL = re.compile(r"\\(?:lor|vee)(?![a-zA-Z])|∨")
# What marks a hedge in a sentence around a bare last number (relations there are reasoning).
_HEDGES_IN_PROSE = ("a disjunction", "a guess", "an approximation")
_SPACES = re.compile(r"\s+|\\[,;:! ]|\\q?quad(?![a-zA-Z])|\\(?:left|right)(?![a-zA-Z])")
_PLAIN_NUMBER = re.compile(r"([-+]?)(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?", re.ASCII)


class _HideDisabledTimeoutWarning(logging.Filter):
    """math-verify warns that with its timeouts off nothing stops a runaway check; ours does."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_HideDisabledTimeoutWarning())


def last_boxed(text: str) -> str | None:
    """Content of the last well-formed \\boxed{...} (nested braces allowed) or \\boxed 5."""
    return next((content for _, _, content in _boxed_from_the_end(text)), None)


def _boxed_from_the_end(text: str) -> Iterator[tuple[int, int, str]]:
    """(start, end, content) of each well-formed box in the text's last MAX_EXTRACTION_CHARS,
    last first; positions are in that window."""
    text = text[-MAX_EXTRACTION_CHARS:]
    closing = _matching_braces(text)
    for match in reversed(list(_BOXED.finditer(text))):
        start = match.end()
        if text.startswith("{", start):
            end = closing.get(start)
            if end is not None:
                yield match.start(), end + 1, text[start + 1 : end].strip()
        else:
            token = _TOKEN.match(text, start)
            if token:
                yield match.start(), token.end(), token.group(0)


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
    boxes = list(itertools.islice(_boxed_from_the_end(response), 2))
    if boxes and boxes[0][2]:
        return _hedged_boxes(response, boxes) or boxes[0][2], "boxed"
    stated = _ANSWER_IS.findall(response)
    if stated:
        answer = stated[-1].strip().strip("*").rstrip(".").strip().strip("$").strip()
        if answer:
            return answer, "stated"
    last = collections.deque(_NUMBER.finditer(response), maxlen=1)
    if not last:
        return None
    number = last[0]
    line = _line_around(response, number.start())
    if any(_HEDGES[what].search(line) for what in _HEDGES_IN_PROSE):
        return line, "last line"  # "so it is 6 or 7": the hedge check refuses it
    return number.group(0).replace(",", ""), "last number"


def _hedged_boxes(response: str, boxes: list[tuple[int, int, str]]) -> str | None:
    """`\\boxed{6} or \\boxed{7}`: the two boxes and what joins them, as one answer for the
    hedge check; None when the last box stands alone."""
    if len(boxes) < 2:
        return None
    (start, _, last), (_, end, before) = boxes
    joint = response[end:start].replace("$", "")
    if "\n" in joint or _normal_text(before) == _normal_text(last):
        return None
    if any(_HEDGES[what].search(joint) for what in _HEDGES_IN_PROSE):
        return f"{before}{joint}{last}"
    return None


def _line_around(text: str, position: int) -> str:
    end = text.find("\n", position)
    return text[text.rfind("\n", 0, position) + 1 : len(text) if end < 0 else end].strip()


def equivalent(gold: str, candidate: str, budget_s: float | None = None) -> bool:
    """Whether the candidate answer equals the gold one: the same text, the same plain number,
    else per math-verify with the numeric rules above, within `budget_s` seconds of parsing
    and comparing (time_budget.within).

    Raises AnswerRefused for a hedge, AnswerTooCostly for answers refused up front and for a
    comparison past its budget."""
    if _normal_text(gold) == _normal_text(candidate):
        return True
    _check_one_value(gold, candidate)
    gold_number, number = _plain_number(gold), _plain_number(candidate)
    if gold_number is not None and number is not None:
        return _numbers_match(*gold_number, number[0])
    if len(gold) > MAX_ANSWER_CHARS:
        # Parsing and comparing a long gold answer can outlast the deadline; the same text
        # (checked above) is the only way to match it, or a plain number (just above).
        return False
    _check_shape(candidate)
    if _GOLDS_PAST_BUDGET[gold] >= GOLD_PARSE_TRIES:
        raise AnswerTooCostly(_GOLD_PAST_BUDGET)
    tries = _GOLDS_PAST_BUDGET[gold]
    try:
        with within(budget_s):
            return _compare(gold, candidate)
    except BudgetSpent:
        if _GOLDS_PAST_BUDGET[gold] > tries:  # spent on parsing the gold itself
            raise AnswerTooCostly(_GOLD_PAST_BUDGET) from None
        raise AnswerTooCostly(f"comparing with the gold answer took over {budget_s:g} s") from None


def matched_as_text_only(gold: str) -> bool:
    """Whether `equivalent` matches the gold answer by its own text only: one longer than
    MAX_ANSWER_CHARS is never parsed, unless it is a plain number, which a plain number
    answer is still compared with."""
    return len(gold) > MAX_ANSWER_CHARS and _plain_number(gold) is None


def _normal_text(answer: str) -> str:
    return _SPACES.sub("", answer).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")


def _check_one_value(gold: str, candidate: str) -> None:
    for what, pattern in _HEDGES.items():
        allowed = pattern.search(gold) or _ALLOWED_BY_GOLD.get(what, _NEVER).search(gold)
        if pattern.search(candidate) and not allowed:
            raise AnswerRefused(f"not one value: {what}")


def _plain_number(answer: str) -> tuple[sympy.Rational, bool] | None:
    """(exact value, whether written as a decimal) of an answer that is only a number such as
    -1,234.50 (no conversion through float); None for anything else."""
    match = _PLAIN_NUMBER.fullmatch(answer.strip().strip("$").strip())
    if match is None or len(match.group(0)) > MAX_LITERAL_DIGITS:
        return None
    sign, whole, decimals = match.groups()
    text = f"{sign}{whole.replace(',', '')}.{decimals or '0'}"
    return sympy.Rational(text), decimals is not None


def _numbers_match(gold: sympy.Expr, is_decimal: bool, value: sympy.Expr) -> bool:
    """Exact for a rational gold answer (an integer or a fraction); within REL_TOL for a
    decimal or irrational one (complex numbers too; NaN and infinities match nothing)."""
    if gold.is_Rational and not is_decimal:
        return bool(value.is_Rational) and value == gold
    if gold.is_Rational and value.is_Rational:
        # exactly: a gold decimal past a float's range (a long one) would be infinite as a
        # complex, and every answer within an infinite tolerance of it
        return abs(value - gold) <= max(_EXACT_REL_TOL * abs(gold), _EXACT_ABS_TOL)
    try:
        difference, size = complex(sympy.N(value - gold, 30)), complex(sympy.N(gold, 30))
    except (TypeError, ValueError):  # zoo, oo: no finite value
        return False
    if not (cmath.isfinite(difference) and cmath.isfinite(size)):
        return False  # beyond a float's range: nothing is within a tolerance of it
    return abs(difference) <= max(REL_TOL * abs(size), ABS_TOL)


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
    try:
        gold_parsed = _parse(gold)  # once per gold and process (_parse is cached)
    except BudgetSpent:
        _GOLDS_PAST_BUDGET[gold] += 1
        raise
    parsed = _parse(candidate)
    for expr in (*parsed, *gold_parsed):
        _check_cost(expr)
    value, gold_value = _first_expression(parsed), _first_expression(gold_parsed)
    if _is_collection(value) and not _is_collection(gold_value):
        raise AnswerRefused("not one value: several answers")
    if _is_number(value) and _is_number(gold_value) and _has_decimal(value, gold_value):
        # math-verify would round both to 6 decimal places; without a decimal on either side
        # its comparison is exact already.
        exact_gold = _rationalize(gold_value)
        is_decimal = exact_gold is not gold_value
        # doit: the parser leaves 2^{10} or \sqrt{36} unevaluated, which is not yet a Rational
        return _numbers_match(exact_gold.doit(), is_decimal, _rationalize(value).doit())
    # Relations and sets compared both ways: an inequality reaches here only against a gold
    # inequality or interval (_check_one_value).
    return verify(
        gold_parsed,
        parsed,
        float_rounding=FLOAT_DECIMALS,
        allow_set_relation_comp=True,
        timeout_seconds=None,
    )


def _first_expression(parsed: list) -> object:
    return next((expr for expr in parsed if isinstance(expr, sympy.Basic)), None)


def _is_collection(expr: object) -> bool:
    """Several values: a list, tuple or set of them (an interval is one answer)."""
    return isinstance(expr, sympy.FiniteSet | sympy.Tuple)


def _is_number(expr: object) -> bool:
    # A percentage (10\% is 10 * UnevaluatedExpr(1/100)) is left to math-verify, for which
    # 10\% equals both 10 and 0.1.
    return (
        isinstance(expr, sympy.Expr)
        and bool(expr.is_number)
        and not expr.has(sympy.UnevaluatedExpr)
    )


def _has_decimal(*exprs: sympy.Expr) -> bool:
    return any(expr.has(sympy.Float) for expr in exprs)


def _rationalize(expr: sympy.Expr) -> sympy.Expr:
    """The expression with each decimal replaced by the exact rational its digits spell, so
    0.75 is 3/4 and not the binary float nearest to it; the same object when it has none."""
    floats = expr.atoms(sympy.Float)
    if not floats:
        return expr
    return expr.xreplace({f: sympy.Rational(str(f)) for f in floats})


@functools.lru_cache(maxsize=4096)
def _parse(answer: str) -> list:
    # Wrapping in $...$ makes math-verify read the text as LaTeX (plain numbers work too).
    # It reads `a \lor b` as b alone, and `a \text{ or } b` as both.
    answer = _OR_SYMBOL.sub(lambda _: r" \text{ or } ", answer)
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
