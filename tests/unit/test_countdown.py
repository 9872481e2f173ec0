"""Countdown: generation, the safe expression evaluator, and the verifier."""

import itertools
import time
from fractions import Fraction

import pytest

from groupflow.core.records import Prompt
from groupflow.reward_workers.tasks.countdown import (
    BadExpression,
    CountdownTask,
    evaluate,
    extract_expression,
)


def _prompt(numbers, target):
    return Prompt("t", "t", {"numbers": numbers, "target": target})


def test_train_prompts_reproducible_and_disjoint_from_eval():
    task = CountdownTask()
    first = [p.uid for p in itertools.islice(task.train_prompts(3), 300)]
    assert first == [p.uid for p in itertools.islice(task.train_prompts(3), 300)]
    held_out = {p.uid for p in task.eval_prompts(30)}
    assert len(held_out) == 30
    assert not held_out & set(first)


def test_generated_targets_are_reachable_with_all_numbers():
    # Brute force over every expression tree: each generated target must be reachable.
    def reachable(values):
        if len(values) == 1:
            return {values[0]}
        out = set()
        for i, j in itertools.permutations(range(len(values)), 2):
            rest = [v for k, v in enumerate(values) if k not in (i, j)]
            a, b = values[i], values[j]
            for v in {a + b, a - b, a * b} | ({a / b} if b else set()):
                out |= reachable([*rest, v])
        return out

    task = CountdownTask(count=3, max_number=20, max_target=200)
    for prompt in itertools.islice(task.train_prompts(0), 20):
        numbers, target = prompt.answer["numbers"], prompt.answer["target"]
        assert 1 <= target <= 200
        assert Fraction(target) in reachable([Fraction(n) for n in numbers])


def test_evaluate_is_exact():
    value, used = evaluate("(1 + 2) / 3 * 7 - 1/3")
    assert value == Fraction(20, 3)
    assert used == [1, 2, 3, 7, 1, 3]


@pytest.mark.parametrize(
    ("expression", "problem"),
    [
        ("2 ** 10 ** 10", "Pow"),
        ("2 ^ 3", "BitXor"),
        ("-5 + 10", "USub"),
        ("__import__('os').system('true')", "Call"),
        ("x + 1", "Name"),
        ("1.5 * 2", "Constant"),
        ("True + 1", "Constant"),
        ("0x10 + 1", "not a plain number"),
        ("1_0 + 1", "not a plain number"),
        ("9" * 13 + " + 1", "not a plain number"),
        ("5 / (3 - 3)", "division by zero"),
        ("(1, 2)", "Tuple"),
        ("", "not a valid arithmetic expression"),
        ("1 +", "not a valid arithmetic expression"),
        ("1\x00+2", "not a valid arithmetic expression"),
        ("(" * 101 + "1" + ")" * 101, "longer than"),
        ("1+(" * 40 + "1" + ")" * 40, "nested deeper"),
        ("999999999999 * 999999999999 * 999999999999", "too large"),
    ],
)
def test_evaluate_refuses(expression, problem):
    """Refused quickly, before any large computation."""
    start = time.perf_counter()
    with pytest.raises(BadExpression, match=problem):
        evaluate(expression)
    assert time.perf_counter() - start < 0.5


def test_redundant_parentheses_do_not_count_as_depth():
    assert evaluate("(" * 90 + "1" + ")" * 90) == (1, [1])


@pytest.mark.parametrize(
    ("response", "expression"),
    [
        ("<answer> (1 + 2) * 3 </answer>", "(1 + 2) * 3"),
        ("think...\n<answer>1+2</answer> then <answer>3*4</answer>", "3*4"),
        ("reasoning\n(1 + 2) * 3 = 9", "(1 + 2) * 3"),
        ("<answer>9 = (1+2)*3</answer>", "(1+2)*3"),
        ("<answer>(7 × 3) − 4 ÷ 2</answer>", "(7 * 3) - 4 / 2"),
        ("<answer>9</answer>", "9"),
        ("", None),
        ("<answer>1+2 = 3+0</answer>", None),
    ],
)
def test_extract_expression(response, expression):
    assert extract_expression(response) == expression


@pytest.mark.parametrize(
    ("response", "reward", "reason"),
    [
        ("<answer>(6 - 2) * 5 + 4</answer>", 1.0, "correct"),
        ("<answer>6 * 4</answer>", 1.0, "correct"),  # a subset of the numbers is fine
        ("<answer>(6 × 4)</answer>", 1.0, "correct"),
        ("<answer>6 * 5</answer>", 0.0, "wrong"),
        ("<answer>6 * 4 * 1</answer>", 0.0, "not given"),
        ("<answer>6 + 6 + 6 + 6</answer>", 0.0, "not given"),  # 6 used four times
        ("<answer>6 ** 2</answer>", 0.0, "malformed"),
        ("<answer>__import__('os').system('echo hi')</answer>", 0.0, "malformed"),
        ("", 0.0, "no expression"),
        ("<answer></answer>", 0.0, "no expression"),
        ("<answer>٦ * ٤</answer>", 0.0, "malformed"),  # non-ASCII digits are not numbers here
        ("<answer>" + "(" * 5000 + "</answer>", 0.0, "malformed"),
    ],
)
def test_verify(response, reward, reason):
    verdict = CountdownTask().verify(_prompt([6, 2, 5, 4], 24), response)
    assert verdict.reward == reward
    assert reason in verdict.reason


@pytest.mark.parametrize(
    "response",
    [
        "<answer>6 * 4 or (6 - 2) * 5 + 4</answer>",
        "<answer>6 * 4, 5 * 4</answer>",
        "<answer>6 * 4; 5 * 4</answer>",
        "<answer>[6 * 4, 5 * 4]</answer>",
        "<answer>6 * 4 if True else 5</answer>",
        "<answer>24 = 6 * 4 = 5 * 4 + 4</answer>",
        "<answer>6 * 4 ≈ 24</answer>",
        "<answer>6 * 4 (or 5 * 4)</answer>",
        "<answer>6 * 4 | 5 * 4</answer>",
        "<answer>6 * 4 ± 0</answer>",
        "<answer>(6 * 4, 5 * 4)</answer>",
        "<answer>6 * 4 < 25</answer>",
    ],
)
def test_several_candidate_expressions_are_refused(response):
    verdict = CountdownTask().verify(_prompt([6, 2, 5, 4], 24), response)
    assert verdict.reward == 0.0, verdict.reason


@pytest.mark.parametrize(
    "response",
    [
        "<answer>6 * 4 = 24</answer>",
        "<answer>24 = 6 * 4</answer>",
        "<answer>\r\n  6 * 4\r\n</answer>",
        "Work...\n6 × 4 = 24",
        "<answer>(6 − 2) · 5 + 4</answer>",
    ],
)
def test_one_expression_in_any_legitimate_spelling_scores_one(response):
    verdict = CountdownTask().verify(_prompt([6, 2, 5, 4], 24), response)
    assert verdict.reward == 1.0, verdict.reason


def test_format_weight_blends_in():
    task = CountdownTask(format_weight=0.2)
    prompt = _prompt([6, 4], 24)
    assert task.verify(prompt, "<answer>6*4</answer>").reward == pytest.approx(1.0)
    assert task.verify(prompt, "6*4").reward == pytest.approx(0.8)
    assert task.verify(prompt, "<answer>6+4</answer>").reward == pytest.approx(0.2)


def test_parse_answer_and_options_validate():
    task = CountdownTask()
    assert task.parse_answer({"numbers": [1, 2], "target": 3}) == {"numbers": [1, 2], "target": 3}
    for bad in (
        {"numbers": [1, "2"], "target": 3},
        {"numbers": [1], "target": 2.5},
        [1, 2],
        {"target": 3},
    ):
        with pytest.raises(ValueError):
            task.parse_answer(bad)
    with pytest.raises(ValueError, match="countdown"):
        CountdownTask(count=9)
    with pytest.raises(ValueError, match="format_weight"):
        CountdownTask(format_weight=1.5)
