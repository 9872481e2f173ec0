"""Math word problems with a final answer, checked for equivalence by math-verify.

Prompts come from a small built-in set, or from a dataset file (JSONL/Parquet, see
reward_workers.datasets) with `dataset=...` and a field mapping.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from groupflow.core.records import Prompt, Verdict
from groupflow.reward_workers.format_reward import blend_format, check_format_weight
from groupflow.reward_workers.gold_answers import worked_solutions
from groupflow.reward_workers.reader_view import disguised
from groupflow.reward_workers.tasks.math_answer import (
    MAX_ANSWER_CHARS,
    AnswerRefused,
    AnswerTooCostly,
    equivalent,
    extract_answer,
    last_boxed,
    matched_as_text_only,
)
from groupflow.reward_workers.tasks.options import check_positive_seconds
from groupflow.reward_workers.tasks.prompt_pool import PooledTask

DEFAULT_INSTRUCTION = "Put your final answer in \\boxed{}."
# The share of `timeout_s` that parsing and comparing an answer may spend before the check
# ends as a refusal (a plain verdict); the rest is for extraction, and the scorer process is
# killed only at `timeout_s` plus a margin (a timeout verdict and a restart).
COMPARE_SHARE = 0.8

# (problem, answer, held out for evaluation)
BUILTIN_PROBLEMS: tuple[tuple[str, str, bool], ...] = (
    (
        "A baker makes 14 trays of 12 rolls and sells all but 9 rolls. How many rolls does she sell?",
        "159",
        False,
    ),
    ("What is the sum of the interior angles of a hexagon, in degrees?", "720", False),
    ("Simplify $\\frac{18}{24}$.", "\\frac{3}{4}", False),
    ("What is $\\sqrt{50}$ in simplest radical form?", "5\\sqrt{2}", False),
    ("Solve for $x$: $3x - 7 = 11$.", "6", False),
    (
        "A shirt costs 40 dollars and is discounted by 15%. What is the sale price in dollars?",
        "34",
        False,
    ),
    ("What is the least common multiple of 12 and 18?", "36", False),
    ("How many positive divisors does 36 have?", "9", False),
    ("What is the remainder when $2^{10}$ is divided by 7?", "2", False),
    ("Evaluate $\\binom{6}{2}$.", "15", False),
    ("A rectangle has perimeter 30 and length 9. What is its area?", "54", False),
    ("What is the slope of the line through $(1, 2)$ and $(4, 11)$?", "3", False),
    ("Compute $(-2)^3 + 3^2$.", "1", False),
    ("What is $0.25 \\times 0.4$?", "0.1", False),
    ("Find the positive solution of $x^2 = 5x + 14$.", "7", False),
    (
        "The mean of five numbers is 8. Four of them are 6, 7, 9 and 10. What is the fifth?",
        "8",
        False,
    ),
    ("What is the area of a circle with radius 3?", "9\\pi", False),
    ("A train travels 180 km in 2.5 hours. What is its average speed in km/h?", "72", False),
    ("Write $0.\\overline{3}$ as a fraction in lowest terms.", "\\frac{1}{3}", False),
    ("How many ways can 4 different books be arranged on a shelf?", "24", False),
    ("What is the greatest common divisor of 84 and 126?", "42", True),
    ("Solve for $y$: $\\frac{y}{4} + 3 = 5$.", "8", True),
    ("What is the hypotenuse of a right triangle with legs 6 and 8?", "10", True),
    ("A number increased by 20% is 54. What is the number?", "45", True),
    ("Simplify $\\sqrt{12} \\cdot \\sqrt{3}$.", "6", True),
    ("What is the probability of rolling a sum of 7 with two fair dice?", "\\frac{1}{6}", True),
)


class MathTask(PooledTask):
    """Answers are compared with math-verify; the scorer process running a check is killed
    after `timeout_s` seconds."""

    name = "math"

    def __init__(
        self,
        dataset: str | None = None,
        eval_dataset: str | None = None,
        fields: Mapping[str, str] | str | None = None,
        skip_bad: bool = False,
        eval_fraction: float = 0.1,
        skip_prompts: Sequence[str] = (),
        instruction: str = DEFAULT_INSTRUCTION,
        timeout_s: float = 5.0,
        format_weight: float = 0.0,
    ):
        check_positive_seconds(self.name, "timeout_s", timeout_s)
        self.instruction, self.timeout_s = instruction, timeout_s
        self.format_weight = check_format_weight(self.name, format_weight)
        self._load_pool(dataset, eval_dataset, fields, skip_bad, eval_fraction, skip_prompts)

    def _builtin_split(self) -> tuple[list[Prompt], list[Prompt]]:
        train, held_out = [], []
        for i, (problem, answer, is_eval) in enumerate(BUILTIN_PROBLEMS):
            prompt = self._instructed(Prompt(uid=f"math-{i}", text=problem, answer=answer))
            (held_out if is_eval else train).append(prompt)
        return train, held_out

    def parse_answer(self, raw: Any) -> str:
        if isinstance(raw, bool) or not isinstance(raw, str | int | float):
            raise ValueError(f"expected the answer as text or a number, got {type(raw).__name__}")
        if not str(raw).strip():
            raise ValueError("empty answer")
        return str(raw).strip()

    def gold_answer_warning(self) -> str | None:
        answers = (p.answer for p in self.pool.train + self.pool.held_out)
        found = worked_solutions(answers, matched_as_text_only)
        return found.message(MAX_ANSWER_CHARS) if found.flagged else None

    def verify(self, prompt: Prompt, response: str) -> Verdict:
        if any(disguised(response, marker) for marker in ("\\boxed", "\\fbox")):
            # a box a reader sees and extract_answer does not: the answer read is not the one
            # shown last, nor counted in the hedge check
            return Verdict(0.0, "a disguised \\boxed: the answer is not where it seems")
        verdict = self._check(prompt.answer, response)
        return blend_format(verdict, last_boxed(response) is not None, self.format_weight)

    def _check(self, gold: str, response: str) -> Verdict:
        found = extract_answer(response)
        if found is None:
            return Verdict(0.0, "no answer found")
        answer, how = found
        shown = answer if len(answer) <= 60 else answer[:57] + "..."
        try:
            same = equivalent(gold, answer, COMPARE_SHARE * self.timeout_s)
        except (AnswerTooCostly, AnswerRefused) as err:
            return Verdict(0.0, f"refused ({how}): {err}")
        if same:
            return Verdict(1.0, f"correct ({how}): {shown}")
        if matched_as_text_only(gold):
            return Verdict(
                0.0,
                f"wrong ({how}): {shown} is not the gold answer's text (a gold answer longer "
                f"than {MAX_ANSWER_CHARS} characters is compared as text only; a worked "
                "solution? see the dataset's fields.answer_format)",
            )
        return Verdict(0.0, f"wrong ({how}): {shown} != {gold}")
