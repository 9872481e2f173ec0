"""Long addition with a written scratchpad: `4738+2956=` answered column by column, right to
left, each column as `a+b+carry=` and its two-digit sum (carry out, then the digit), then
`answer 7694`:

    8+6+0=14 3+5+1=09 7+9+0=16 4+2+1=07 answer 7694

A response is 9 characters per column plus the answer, 38-56 tokens with the built-in
character tokenizer for 3-5 digits (3 by default): long enough that a confident policy
samples a token it was sure against now and then, which is what the token-credit methods act
on (docs/algorithms.md, docs/long_addition.md). Only the final answer is checked; the scratchpad is the model's own
business (docs/verifiers.md).
"""

from __future__ import annotations

import random
import re
import unicodedata
from typing import Any

from groupflow.core.records import Prompt, Verdict
from groupflow.reward_workers.reader_view import lookalike, normalised
from groupflow.reward_workers.tasks.base import GeneratedTask, hash_position
from groupflow.reward_workers.tasks.options import check_int

ANSWER_MARKER = "answer"
# The marker as a reader would see it, in the normalised text (reward_workers/reader_view.py):
# its letters or any letters outside ASCII that look like them (Cyrillic а), and anywhere,
# inside a longer word too ("answers: 769." is an answer). A response holds one, at its very
# end: the one span an answer can occupy.
_MARKER = re.compile(lookalike(ANSWER_MARKER))
# The marker, then one integer, then nothing but white space. Anything after the integer (a
# second value, a hedge, a fraction, prose) refuses the answer.
_FINAL = re.compile(rf"{_MARKER.pattern}[ \t]+(\d+)\s*\Z")


# The separator before each column after the first and before the answer, with its share in
# the demonstrations: nearly always a space, rarely something else that changes nothing. A
# slip into a rare separator leaves the sum intact, so a correct response can hold a token the
# policy gave p ~ 1e-3: the harmless improbable token STAPO calls spurious. Without them every
# token of a correct scratchpad is forced and only wrong responses hold improbable tokens.
# Each rare one is taught at 0.15%, so that the warm-started policy gives it p < 0.002 (at
# 0.6% it learned p ~ 0.005: improbable, but above STAPO's tau_p), and six of them keep a slip
# at about 1% of separators, a few in every step of 128 responses.
SEPARATORS = (
    (" ", 0.991),
    (",", 0.0015),
    (".", 0.0015),
    ("(", 0.0015),
    (")", 0.0015),
    ("*", 0.0015),
    ("/", 0.0015),
)


def separator(draw: float) -> str:
    """The separator a uniform draw in [0, 1) picks from SEPARATORS."""
    for text, share in SEPARATORS:
        if draw < share:
            return text
        draw -= share
    return SEPARATORS[0][0]


def scratchpad(a: int, b: int, draws: list[float] | None = None) -> str:
    """The worked sum of two non-negative integers, as the warm start teaches it; `draws`
    (one per separator, uniform in [0, 1)) pick the separators, all spaces without them."""
    columns, carry = [], 0
    xs, ys = str(a)[::-1], str(b)[::-1]
    width = max(len(xs), len(ys))
    seps = [separator(d) for d in draws] if draws is not None else [" "] * width
    for i in range(width):
        x = int(xs[i]) if i < len(xs) else 0
        y = int(ys[i]) if i < len(ys) else 0
        total = x + y + carry
        columns.append(("" if i == 0 else seps[i - 1]) + f"{x}+{y}+{carry}={total:02d}")
        carry = total // 10
    return "".join(columns) + f"{seps[width - 1]}{ANSWER_MARKER} {a + b}"


class LongAdditionTask(GeneratedTask):
    """The sum of two `digits`-digit numbers, worked on a scratchpad."""

    name = "long_addition"

    def __init__(self, digits: int = 3):
        # 24 digits make a response of about 230 tokens, near the built-in model's 256 positions
        check_int(self.name, "digits", digits, 1, 24)
        self.digits = digits

    def _make(self, rng: random.Random) -> Prompt:
        low, high = 10 ** (self.digits - 1), 10**self.digits - 1
        a, b = rng.randint(low, high), rng.randint(low, high)
        ask = (
            f"Add {a} and {b} column by column from the right, writing each column as "
            f"digit+digit+carry=two-digit sum, then end with '{ANSWER_MARKER} N'."
        )
        return Prompt(
            uid=f"{a}+{b}",
            text=f"{a}+{b}=",
            answer=a + b,
            messages=[{"role": "user", "content": ask}],
        )

    DEMONSTRATION_FORMAT = f"columns a+b+carry=sum, separators {SEPARATORS}"

    def demonstration(self, prompt: Prompt) -> str:
        """The prompt's scratchpad, its separators drawn from a hash of the prompt (the same
        in every run)."""
        a, b = (int(x) for x in prompt.uid.split("+"))
        draws = [hash_position(f"{prompt.uid}/{i}") for i in range(self.digits)]
        return scratchpad(a, b, draws)

    def parse_answer(self, raw: Any) -> int:
        if type(raw) is not int or raw < 0:
            raise ValueError(f"expected a non-negative integer, got {raw!r}")
        return raw

    def verify(self, prompt: Prompt, response: str) -> Verdict:
        """The integer after the one `answer` marker, at the very end, compared exactly as
        digits (never converted to an int, so its length costs nothing). Markers are counted
        in the normalised text, so that a disguised one (`аnswer`, `ANSWERS:`, `ans\u200bwer`)
        is a second answer, not text the verifier skips."""
        response = normalised(response)
        markers = len(_MARKER.findall(response))
        if markers == 0:
            return Verdict(0.0, f"no final '{ANSWER_MARKER} N'")
        if markers > 1:
            return Verdict(0.0, f"{markers} final answers; one is allowed")
        match = _FINAL.search(response)
        if match is None:
            tail = response[_MARKER.search(response).start() :][:40]
            return Verdict(0.0, f"not one integer at the end: {tail!r}")
        digits = "".join(str(unicodedata.decimal(c)) for c in match.group(1))
        got = digits.lstrip("0") or "0"
        want = str(prompt.answer)
        if got == want:
            return Verdict(1.0, f"correct: {want}")
        shown = got if len(got) <= 30 else f"a {len(got)}-digit number"
        return Verdict(0.0, f"wrong: {shown} != {want}")
