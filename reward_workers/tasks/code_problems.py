"""Write a Python function: checked against input/output tests in the sandbox.

Reward = fraction of test cases passed (partial credit). Prompts come from a small built-in
set, or from a dataset file whose answer field holds {"entry_point": ..., "tests": [...]}
(see reward_workers.tasks.code_tests.parse_spec).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from groupflow.core.records import Prompt, Verdict
from groupflow.reward_workers.format_reward import blend_format, check_format_weight
from groupflow.reward_workers.sandbox import default_platform, require_strong
from groupflow.reward_workers.tasks.code_tests import extract_code, parse_spec, run_tests
from groupflow.reward_workers.tasks.options import check_int, check_positive_seconds
from groupflow.reward_workers.tasks.prompt_pool import PooledTask

DEFAULT_INSTRUCTION = "Reply with the complete function in a ```python code block."

# (description, entry point, tests as (args, expected), held out for evaluation)
BUILTIN_PROBLEMS: tuple[tuple[str, str, list[tuple[list, Any]], bool], ...] = (
    (
        "Write a function `reverse_words(s)` that returns the words of `s` in reverse order, "
        "separated by single spaces.",
        "reverse_words",
        [
            (["hello big world"], "world big hello"),
            (["one"], "one"),
            (["  a   b "], "b a"),
            ([""], ""),
        ],
        False,
    ),
    (
        "Write a function `is_palindrome(s)` that tells whether `s` reads the same backwards, "
        "ignoring case and every character that is not a letter or digit.",
        "is_palindrome",
        [
            (["A man, a plan, a canal: Panama"], True),
            (["abc"], False),
            ([""], True),
            (["No 'x' in Nixon"], True),
        ],
        False,
    ),
    (
        "Write a function `fizzbuzz(n)` that returns a list of strings for 1..n: 'Fizz' for "
        "multiples of 3, 'Buzz' for multiples of 5, 'FizzBuzz' for both, else the number.",
        "fizzbuzz",
        [
            ([5], ["1", "2", "Fizz", "4", "Buzz"]),
            ([0], []),
            ([15], [*"1 2 Fizz 4 Buzz Fizz 7 8 Fizz Buzz 11 Fizz 13 14".split(), "FizzBuzz"]),
        ],
        False,
    ),
    (
        "Write a function `gcd(a, b)` that returns the greatest common divisor of two "
        "non-negative integers (gcd(0, 0) is 0).",
        "gcd",
        [([12, 18], 6), ([17, 5], 1), ([0, 9], 9), ([0, 0], 0), ([1071, 462], 21)],
        False,
    ),
    (
        "Write a function `count_vowels(s)` that counts the vowels (a, e, i, o, u, either case) in `s`.",
        "count_vowels",
        [(["Hello World"], 3), (["xyz"], 0), (["AEIOUaeiou"], 10), ([""], 0)],
        False,
    ),
    (
        "Write a function `second_largest(nums)` that returns the second largest distinct value "
        "in the list, or None if there is none.",
        "second_largest",
        [([[3, 1, 4, 1, 5]], 4), ([[7, 7, 7]], None), ([[2]], None), ([[-1, -2]], -2)],
        False,
    ),
    (
        "Write a function `run_length(s)` that encodes runs of equal characters as the "
        "character followed by the run length, e.g. 'aaab' -> 'a3b1'.",
        "run_length",
        [(["aaab"], "a3b1"), ([""], ""), (["abc"], "a1b1c1"), (["zzzzzzzzzzzz"], "z12")],
        False,
    ),
    (
        "Write a function `flatten(items)` that flattens arbitrarily nested lists into one list.",
        "flatten",
        [([[1, [2, [3, [4]]], 5]], [1, 2, 3, 4, 5]), ([[]], []), ([[[[]], [1]]], [1])],
        False,
    ),
    (
        "Write a function `roman_to_int(s)` that converts a Roman numeral to an integer.",
        "roman_to_int",
        [(["III"], 3), (["IV"], 4), (["MCMXCIV"], 1994), (["LVIII"], 58)],
        False,
    ),
    (
        "Write a function `two_sum(nums, target)` that returns the indices [i, j], i < j, of the "
        "two numbers that add up to target (there is exactly one such pair).",
        "two_sum",
        [([[2, 7, 11, 15], 9], [0, 1]), ([[3, 2, 4], 6], [1, 2]), ([[1, 5, 1, 5], 10], [1, 3])],
        False,
    ),
    (
        "Write a function `max_subarray(nums)` that returns the largest sum of a non-empty "
        "contiguous sub-list.",
        "max_subarray",
        [([[-2, 1, -3, 4, -1, 2, 1, -5, 4]], 6), ([[-3, -1, -2]], -1), ([[5]], 5)],
        False,
    ),
    (
        "Write a function `is_prime(n)` that tells whether the integer `n` is prime.",
        "is_prime",
        [([2], True), ([1], False), ([97], True), ([91], False), ([0], False), ([7919], True)],
        False,
    ),
    (
        "Write a function `merge_intervals(intervals)` that merges overlapping [start, end] "
        "intervals and returns them sorted by start.",
        "merge_intervals",
        [
            ([[[1, 3], [2, 6], [8, 10]]], [[1, 6], [8, 10]]),
            ([[[1, 4], [4, 5]]], [[1, 5]]),
            ([[]], []),
        ],
        True,
    ),
    (
        "Write a function `balanced(s)` that tells whether the brackets ()[]{} in `s` are "
        "balanced and properly nested (other characters are ignored).",
        "balanced",
        [(["([]{})"], True), (["(]"], False), (["(("], False), (["a(b)c"], True), ([""], True)],
        True,
    ),
    (
        "Write a function `binary_search(nums, target)` that returns the index of target in the "
        "sorted list nums, or -1 if it is absent.",
        "binary_search",
        [([[1, 3, 5, 7, 9], 7], 3), ([[1, 3, 5], 4], -1), ([[], 1], -1), ([[2], 2], 0)],
        True,
    ),
    (
        "Write a function `mean(nums)` that returns the arithmetic mean of a non-empty list of numbers.",
        "mean",
        [([[1, 2, 3, 4]], 2.5), ([[0.1, 0.2]], 0.15), ([[-5]], -5)],
        True,
    ),
)


class CodeTask(PooledTask):
    """Each solution runs once in the sandbox: `timeout_s` for the whole run,
    `case_timeout_s` per test case, `memory_mb` of address space. Refuses to start where the
    sandbox lacks its kernel layers (docs/sandbox.md) unless `allow_weak_sandbox` is true."""

    name = "code"

    def __init__(
        self,
        dataset: str | None = None,
        eval_dataset: str | None = None,
        fields: Mapping[str, str] | str | None = None,
        skip_bad: bool = False,
        eval_fraction: float = 0.1,
        skip_prompts: Sequence[str] = (),
        instruction: str = DEFAULT_INSTRUCTION,
        timeout_s: float = 10.0,
        case_timeout_s: float = 2.0,
        memory_mb: int = 512,
        format_weight: float = 0.0,
        allow_weak_sandbox: bool = False,
    ):
        self.timeout_s = check_positive_seconds(self.name, "timeout_s", timeout_s)
        self.case_timeout_s = check_positive_seconds(self.name, "case_timeout_s", case_timeout_s)
        self.memory_mb = check_int(self.name, "memory_mb", memory_mb, 64, 1 << 20)
        self.instruction = instruction
        self.format_weight = check_format_weight(self.name, format_weight)
        # No usable sandbox, or one without the kernel layers: fail now, not mid-training.
        require_strong(default_platform(), allow_weak_sandbox is True, "code task")
        self._load_pool(dataset, eval_dataset, fields, skip_bad, eval_fraction, skip_prompts)

    def _builtin_split(self) -> tuple[list[Prompt], list[Prompt]]:
        train, held_out = [], []
        for description, entry_point, tests, is_eval in BUILTIN_PROBLEMS:
            args, expected = tests[0]
            example = f"For example, {entry_point}({', '.join(map(json.dumps, args))}) returns {json.dumps(expected)}."
            spec = {
                "entry_point": entry_point,
                "tests": [{"args": a, "expected": e} for a, e in tests],
            }
            prompt = Prompt(uid=f"code-{entry_point}", text=f"{description} {example}", answer=spec)
            (held_out if is_eval else train).append(self._instructed(prompt))
        return train, held_out

    def parse_answer(self, raw: Any) -> dict[str, Any]:
        return parse_spec(raw)

    def verify(self, prompt: Prompt, response: str) -> Verdict:
        code = extract_code(response, prompt.answer["entry_point"])
        well_formatted = "```" in response and code is not None
        if code is None or not code.strip():
            return blend_format(Verdict(0.0, "no code found"), well_formatted, self.format_weight)
        outcome = run_tests(
            code,
            prompt.answer,
            timeout_s=self.timeout_s,
            case_timeout_s=self.case_timeout_s,
            memory_mb=self.memory_mb,
        )
        reason = f"passed {outcome.passed}/{outcome.total} tests"
        if outcome.first_failure:
            reason += f"; first failure: {outcome.first_failure}"
        verdict = Verdict(outcome.passed / outcome.total, reason)
        return blend_format(verdict, well_formatted, self.format_weight)
