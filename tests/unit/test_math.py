"""Math: answer extraction, math-verify equivalence (from any thread), guards, datasets."""

import collections
import itertools
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from groupflow.core.records import Prompt
from groupflow.reward_workers.tasks import math_answer
from groupflow.reward_workers.tasks.math_answer import (
    REL_TOL,
    AnswerTooCostly,
    equivalent,
    extract_answer,
    last_boxed,
)
from groupflow.reward_workers.tasks.math_problems import MathTask
from groupflow.reward_workers.tasks.time_budget import BudgetSpent


@pytest.mark.parametrize(
    ("text", "boxed"),
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}"),
        ("first \\boxed{1} then \\boxed{ {2} + {3} }", "{2} + {3}"),
        ("\\fbox{7}", "7"),
        ("\\boxed 5 apples", "5"),
        ("\\boxed{3} and a broken \\boxed{4", "3"),
        ("no box", None),
        ("\\boxed{", None),
    ],
)
def test_last_boxed_handles_nesting(text, boxed):
    assert last_boxed(text) == boxed


@pytest.mark.parametrize(
    ("response", "found"),
    [
        ("Thus \\boxed{\\frac{3}{4}}.", ("\\frac{3}{4}", "boxed")),
        ("The answer is $\\frac{3}{4}$.", ("\\frac{3}{4}", "stated")),
        ("Final answer: **12**", ("12", "stated")),
        ("We had 3 apples, then 1,250 more", ("1250", "last number")),
        ("ratio 2/3 in the end", ("2/3", "last number")),
        ("nothing numeric", None),
        ("", None),
    ],
)
def test_extract_answer(response, found):
    assert extract_answer(response) == found


def _gold(answer):
    return Prompt("m", "problem", answer)


@pytest.mark.parametrize(
    ("gold", "response", "reward", "reason"),
    [
        ("\\frac{3}{4}", "\\boxed{0.75}", 1.0, "correct"),
        ("\\frac{3}{4}", "\\boxed{\\dfrac{6}{8}}", 1.0, "correct"),
        ("5\\sqrt{2}", "\\boxed{\\sqrt{50}}", 1.0, "correct"),
        ("9\\pi", "The answer is $9\\pi$", 1.0, "correct"),
        ("159", "so she sells 159 rolls", 1.0, "correct"),
        ("1000", "\\boxed{1,000}", 1.0, "correct"),
        ("\\frac{3}{4}", "\\boxed{\\frac{4}{3}}", 0.0, "wrong"),
        ("159", "\\boxed{160}", 0.0, "wrong"),
        ("159", "", 0.0, "no answer"),
        ("159", "I don't know", 0.0, "no answer"),
        ("159", "\\boxed{½}", 0.0, "wrong"),
        ("159", "\\boxed{１５９}", 0.0, "wrong"),
        ("3", "\\boxed{9^{9^{9^{9}}}}", 0.0, "exponent too large"),
        ("3", "\\boxed{10^{10^{10}}}", 0.0, "exponent too large"),
        ("3", "\\boxed{2^{100000}}", 0.0, "exponent too large"),
        ("3", "\\boxed{(10^{6})!}", 0.0, "factorial too large"),
        ("3", "\\boxed{" + "9+" * 150 + "9}", 0.0, "longer than"),
        ("3", "\\boxed{" + "9" * 500 + "}", 0.0, "wrong"),  # a plain number: compared as one
        ("3", "\\boxed{" + "{" * 40 + "3" + "}" * 40 + "}", 0.0, "nested deeper"),
        ("e^{x^{2}}", "\\boxed{e^{x^2}}", 1.0, "correct"),  # exponents with symbols are fine
    ],
)
def test_verify(gold, response, reward, reason):
    start = time.perf_counter()
    verdict = MathTask().verify(_gold(gold), response)
    assert verdict.reward == reward
    assert reason in verdict.reason
    assert verdict.error is None
    assert time.perf_counter() - start < 5


def test_verify_works_off_the_main_thread():
    # math-verify's own alarm-based timeouts raise outside the main thread; ours must not.
    task = MathTask()
    responses = ["\\boxed{0.75}", "\\boxed{4/3}", "\\boxed{\\frac{3}{4}}", "nothing"]
    with ThreadPoolExecutor(max_workers=2) as pool:
        verdicts = list(pool.map(lambda r: task.verify(_gold("\\frac{3}{4}"), r), responses))
    assert [v.reward for v in verdicts] == [1.0, 0.0, 1.0, 0.0]
    assert threading.current_thread() is threading.main_thread()


def test_builtin_set_split_and_reproducible():
    task = MathTask()
    train = list(itertools.islice(task.train_prompts(5), 60))
    assert [p.uid for p in train] == [p.uid for p in itertools.islice(task.train_prompts(5), 60)]
    held_out = task.eval_prompts(100)
    assert 0 < len(held_out) < 10
    assert not {p.uid for p in held_out} & {p.uid for p in train}
    assert all(p.text.endswith("\\boxed{}.") for p in train + held_out)


def test_every_builtin_answer_verifies_against_itself():
    task = MathTask()
    for prompt in task.pool.train + task.pool.held_out:
        assert task.verify(prompt, f"\\boxed{{{prompt.answer}}}").reward == 1.0, prompt.answer


def test_dataset_prompts_with_field_mapping(tmp_path):
    rows = [{"question": f"What is {i} + {i}?", "solution": 2 * i} for i in range(40)]
    path = tmp_path / "math.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    task = MathTask(
        dataset=str(path), fields={"prompt": "question", "answer": "solution"}, eval_fraction=0.25
    )
    train = task.pool.train
    held_out = task.eval_prompts(100)
    assert len(train) + len(held_out) == 40 and held_out and train
    assert not {p.text for p in train} & {p.text for p in held_out}
    prompt = train[0]
    assert prompt.text.endswith("\\boxed{}.")
    assert task.verify(prompt, f"\\boxed{{{prompt.answer}}}").reward == 1.0


def test_dataset_with_a_bad_answer_is_refused(tmp_path):
    path = tmp_path / "math.jsonl"
    path.write_text(
        '{"prompt": "1+1?", "answer": "2"}\n{"prompt": "2+2?", "answer": [4]}\n'
        '{"prompt": "3+3?", "answer": "6"}\n'
    )
    with pytest.raises(ValueError, match=r"math.jsonl:2: field 'answer'"):
        MathTask(dataset=str(path))
    task = MathTask(dataset=str(path), skip_bad=True, eval_fraction=0.01)
    assert len(task.pool.train) == len(task.pool.held_out) == 1  # one of each side
    assert sorted(p.answer for p in task.pool.train + task.pool.held_out) == ["2", "6"]


def _worked_solution(chars, answer="72"):
    """A GSM8K-style gold answer of exactly `chars` characters ending in `#### <answer>`."""
    steps = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nSo 48+24 = <<48+24=72>>72 in all.\n"
    end = f"#### {answer}"
    return steps + "x" * (chars - len(steps) - len(end) - 1) + "\n" + end


def test_a_long_worked_solution_as_gold_scores_0_until_the_answer_is_cut_out(tmp_path, caplog):
    # The user's case: a right \boxed{72} scored 1 against a 178-character worked solution
    # (math-verify found its last number) but 0 against a 235-character one (compared as text
    # only), with no word at load or in the verdict.
    rows = [
        {"question": f"How many clips, case {i}?", "answer": _worked_solution(n), "id": f"g{i}"}
        for i, n in enumerate([178, 235] * 4)
    ]
    path = tmp_path / "gsm.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    as_is = {"prompt": "question", "answer": "answer", "uid": "id"}
    with caplog.at_level("WARNING"):
        task = MathTask(dataset=str(path), fields=as_is)
        MathTask(dataset=str(path), fields=as_is)  # the driver builds a job's task twice
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith(f"math: {path}: 8 of 8 gold answers look like worked solutions")
    assert (
        "(with ####: 8, over several lines: 8, longer than 200 characters (matched as text only): 4)"
        in warning
    )
    assert "fields.answer_format: gsm8k" in warning and "\n" not in warning
    long = next(p for p in task.pool.train + task.pool.held_out if len(p.answer) == 235)
    verdict = task.verify(long, "so \\boxed{72}")
    assert verdict.reward == 0.0 and "compared as text only" in verdict.reason

    caplog.clear()
    for fields in ("gsm8k", as_is | {"answer_format": "gsm8k"}):
        task = MathTask(dataset=str(path), fields=fields)
        prompts = task.pool.train + task.pool.held_out
        assert {p.answer for p in prompts} == {"72"}
        assert all(task.verify(p, "so \\boxed{72}").reward == 1.0 for p in prompts)
    assert not caplog.records  # final answers: nothing to warn about


def test_the_worked_solution_warning_counts_each_sign(tmp_path, caplog):
    rows = [
        {"prompt": "a?", "answer": "#### 3"},  # the mark
        {"prompt": "b?", "answer": "first 2\nthen 3"},  # several lines
        {"prompt": "c?", "answer": "9" * 201},  # a plain number is one value: not flagged...
        {"prompt": "d?", "answer": "x+" * 101 + "1"},  # ...but a long expression is
        {"prompt": "e?", "answer": "\\frac{1}{2}"},
        {"prompt": "f?", "answer": " 5\n"},  # surrounding white space is not a second line
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with caplog.at_level("WARNING"):
        MathTask(dataset=str(path))
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "3 of 6 gold answers look like worked solutions" in warning
    assert "(with ####: 1, over several lines: 1, longer than 200 characters (matched" in warning


def test_parse_answer():
    task = MathTask()
    assert task.parse_answer(" \\frac{1}{2} ") == "\\frac{1}{2}"
    assert task.parse_answer(7) == "7"
    for bad in ("", None, True, [1]):
        with pytest.raises(ValueError):
            task.parse_answer(bad)


# --- one value, exact where the gold answer is exact (docs/verifiers.md) -------------------

HEDGES = [
    "\\boxed{x = 6 \\lor x = 7}",
    "\\boxed{x = 7 \\lor x = 6}",
    "\\boxed{6 \\vee 7}",
    "\\boxed{6 \\text{ or } 7}",
    "\\boxed{7 \\text{ or } 6}",
    "The answer is 3 (or 6).",
    "The answer is 6 (or 7).",
    "Final answer: either 6 or 7",
    "\\boxed{6 \\approx 7}",
    "\\boxed{7 \\approx 6}",
    "\\boxed{6 \\sim 7}",
    "\\boxed{\\approx 6}",
    "\\boxed{x \\le 6}",
    "\\boxed{x \\geq 6}",
    "\\boxed{6 \\neq 7}",
    "\\boxed{5 < x < 7}",
    "\\boxed{6 \\pm 1}",
    "\\boxed{6, 7}",
    "\\boxed{6; 7}",
    "\\boxed{6, 6}",
    "\\boxed{\\{6, 7\\}}",
    "\\boxed{(6, 7)}",
    "\\boxed{6 \\text{ and } 7}",
    "\\boxed{6 \\text{ (maybe)}}",
    "\\boxed{6 (7)}",
    "\\boxed{x = 7 = 6}",
    "it could be 5, or maybe 6",
    "so it is 6 or 7",
    "roughly 6",
    "\\boxed{x = 6, x = 7}",
    "\\boxed{1,000 \\text{ or } 6}",
    "\\boxed{7} or \\boxed{6}",
    "$\\boxed{7}$ (or maybe $\\boxed{6}$)",
    "\\boxed{7}, perhaps \\boxed{6}",
]


@pytest.mark.parametrize("response", HEDGES)
def test_an_answer_naming_several_values_is_refused(response):
    verdict = MathTask().verify(_gold("6"), response)
    assert verdict.reward == 0.0, verdict.reason


@pytest.mark.parametrize(
    ("gold", "response"),
    [
        ("1, 2", "\\boxed{x = 1 \\text{ or } x = 3}"),
        ("1,000", "\\boxed{1000 \\text{ or } 1}"),  # 1,000 is one value: no disjunction
        ("(-\\infty, 3]", "\\boxed{x \\le 3 \\text{ or } x = 7}"),
        ("\\frac{1}{2}", "\\boxed{\\frac{1}{2} \\approx 0.5}"),
        ("3", "\\boxed{3 \\text{ or } \\pi}"),
    ],
)
def test_a_hedge_is_refused_whatever_the_gold_answer_is(gold, response):
    verdict = MathTask().verify(_gold(gold), response)
    assert verdict.reward == 0.0, verdict.reason


@pytest.mark.parametrize(
    ("gold", "response"),
    [
        ("6", "\\boxed{x = 6}"),
        ("6", "\\boxed{6.0}"),
        ("6", "\\boxed{\\frac{12}{2}}"),
        ("6", "**Final answer:** $6$"),
        ("6", "Since x > 0 we keep x = 6"),
        ("6", "\\boxed{3!}"),  # exact expressions of the value
        ("6", "\\boxed{2^{3}-2}"),
        ("6", "\\boxed{\\sqrt{36}}"),
        ("6", "\\boxed{\\log_2 64}"),
        ("6", "\\boxed{\\binom{4}{2}}"),
        ("6", "\\boxed{0.5 \\cdot 12}"),
        ("6", "first \\boxed{3}\nthen \\boxed{6}"),
        ("6", "we get \\boxed{3}, so the total is \\boxed{6}"),
        ("6", "\\boxed{6} or equivalently \\boxed{6}"),
        ("1, 2", "\\boxed{1} or \\boxed{2}"),
        ("x \\le 3", "\\boxed{x \\leq 3}"),  # a relation in the gold answer is allowed
        ("3 \\pm \\sqrt{2}", "\\boxed{3 \\pm \\sqrt{2}}"),
        ("1, 2", "\\boxed{2, 1}"),
        ("(1, 2)", "\\boxed{(1,2)}"),
        ("\\text{red or blue}", "\\boxed{\\text{red or blue}}"),
        ("(-\\infty, 3]", "\\boxed{x \\le 3}"),  # an interval answered as an inequality
        ("x \\le 3", "\\boxed{(-\\infty, 3]}"),
        ("[2, 5)", "\\boxed{2 \\le x < 5}"),
        ("10\\%", "\\boxed{10}"),  # percentages: math-verify's rule
        ("2+3i", "\\boxed{3i+2}"),
        ("1, 2", "\\boxed{x = 1 \\text{ or } x = 2}"),  # several gold values: roots
        ("1, 2", "\\boxed{x = 2 \\lor x = 1}"),
        ("1, 2", "\\boxed{x = 1, x = 2}"),
        ("x = 1 \\lor x = 2", "\\boxed{x = 2 \\text{ or } x = 1}"),
    ],
)
def test_one_value_in_any_legitimate_spelling_is_accepted(gold, response):
    verdict = MathTask().verify(_gold(gold), response)
    assert verdict.reward == 1.0, verdict.reason


@pytest.mark.parametrize(
    ("gold", "answer", "reward"),
    [
        ("3.14159265", "3.141593", 0.0),  # 7th significant digit: the old 6-decimal rounding
        ("3.14159265", "3.14159265", 1.0),
        ("3.14159265", "3.141592650", 1.0),
        ("0.1", "0.1000001", 0.0),
        ("0.3", "0.30000000000000004", 1.0),  # a float printed at full precision
        ("0.0000001", "0.0000002", 0.0),  # small values: relative, not 6 decimals
        ("\\frac{1}{3}", "0.333333", 0.0),
        ("\\frac{1}{3}", "0.3333333333333333", 0.0),  # a fraction is exact
        ("\\frac{1}{3}", "\\frac{2}{6}", 1.0),
        ("\\frac{3}{4}", "0.75", 1.0),
        ("0.75", "\\frac{3}{4}", 1.0),
        ("1234567", "1234568", 0.0),
        ("1234567", "1234567.0000001", 0.0),  # integers are exact
        ("1234567", "1,234,567", 1.0),
        ("2^{10}", "1024.0000001", 0.0),  # an exact gold expression is exact too
        ("2^{10}", "1024.0", 1.0),
        ("\\sqrt{36}", "6.0000000001", 0.0),
        ("9\\pi", "28.274333882308138", 1.0),  # irrational: within REL_TOL
        ("9\\pi", "28.2743", 0.0),
        ("5\\sqrt{2}", "7.0710678", 0.0),
        ("5\\sqrt{2}", "7.0710678118654755", 1.0),
        ("\\pi", "\\frac{355}{113}", 0.0),
        ("2", "\\sqrt{4.000001}", 0.0),
        ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", 1.0),
        ("\\frac{\\sqrt{2}}{2}", "0.7071067811865476", 1.0),
        ("\\frac{\\sqrt{2}}{2}", "0.7071068", 0.0),
        ("\\pi", "\\frac{0}{0}", 0.0),  # NaN, infinities: no exception, no match
        ("\\pi", "\\frac{1}{0}", 0.0),
        ("\\pi", "\\infty", 0.0),
        ("(-\\infty, 3]", "x < 3", 0.0),
        ("2+3i", "2+3.0000001i", 0.0),
    ],
)
def test_numeric_tolerance_is_exact_for_rationals_and_relative_for_reals(gold, answer, reward):
    verdict = MathTask().verify(_gold(gold), f"\\boxed{{{answer}}}")
    assert verdict.reward == reward, verdict.reason


def test_the_relative_tolerance_is_where_the_docs_say():
    gold = 10**6 * 3.5
    inside, outside = gold * (1 + REL_TOL / 2), gold * (1 + REL_TOL * 3)
    task = MathTask()
    assert task.verify(_gold("3500000.5"), f"\\boxed{{{inside!r}}}").reward == 0.0
    assert task.verify(_gold("3500000.0"), f"\\boxed{{{inside!r}}}").reward == 1.0
    assert task.verify(_gold("3500000.0"), f"\\boxed{{{outside!r}}}").reward == 0.0


@pytest.mark.parametrize("digits", [25, 300, 3000])
def test_long_exact_integers_never_go_through_a_float(digits):
    gold = "7" * digits
    task = MathTask()
    assert task.verify(_gold(gold), f"\\boxed{{{gold}}}").reward == 1.0
    assert task.verify(_gold(gold), f"The answer is {gold[:-1]}8").reward == 0.0
    assert task.verify(_gold(gold), f"\\boxed{{{gold}.0}}").reward == 1.0


LONG_GOLDS = [
    "+".join(f"{i}x^{{{i}}}" for i in range(1, 60)),
    ", ".join(str(i) for i in range(1, 300)),
    "+".join(f"\\frac{{{i}}}{{{i + 1}}}" for i in range(1, 80)),
    "+".join(f"\\sqrt{{{i}}}" for i in range(2, 60)),
    "\\text{" + "word " * 300 + "}",
]


@pytest.mark.parametrize("gold", LONG_GOLDS, ids=lambda g: g[:12])
def test_a_long_gold_answer_is_judged_quickly(gold):
    task = MathTask()
    for response, reward in [
        (f"\\boxed{{{gold}}}", 1.0),
        (f"\\boxed{{ {gold.replace('+', ' + ')} }}", 1.0),
        ("\\boxed{x+1}", 0.0),
        ("\\boxed{5}", 0.0),
    ]:
        start = time.perf_counter()
        verdict = task.verify(_gold(gold), response)
        assert verdict.reward == reward, verdict.reason
        assert time.perf_counter() - start < 1.0


# Under 200 characters, so parsed; compared with a wrong answer sympy ran for seconds (issue
# 39: past the scorer's deadline, a timeout and a process restart instead of a verdict).
COSTLY_GOLD = "+".join(f"\\sin({i}x)\\cos({i + 1}x)" for i in range(1, 10))


def test_a_comparison_past_its_budget_is_a_refusal_in_time():
    task = MathTask(timeout_s=0.5)
    for response in ("\\boxed{5}", "\\boxed{x+1}", "\\boxed{\\sqrt{2}}"):
        start = time.perf_counter()
        verdict = task.verify(_gold(COSTLY_GOLD), response)
        assert (verdict.reward, verdict.error) == (0.0, None)
        assert verdict.reason.startswith("refused (boxed): "), verdict.reason
        assert time.perf_counter() - start < 0.5 + 1.0  # not the seconds sympy took
    assert task.verify(_gold(COSTLY_GOLD), f"\\boxed{{{COSTLY_GOLD}}}").reward == 1.0


def test_a_gold_too_costly_to_parse_is_given_up_after_its_tries(monkeypatch):
    gold = "\\frac{1}{7} + x"  # parsed afresh: an entry of its own in the parse cache
    monkeypatch.setattr(math_answer, "_GOLDS_PAST_BUDGET", collections.Counter())
    real_parse = math_answer._parse
    parses = []

    def parse_past_the_budget(text):
        if text == gold:
            parses.append(text)
            raise BudgetSpent
        return real_parse(text)

    monkeypatch.setattr(math_answer, "_parse", parse_past_the_budget)
    for _ in range(math_answer.GOLD_PARSE_TRIES + 2):
        with pytest.raises(AnswerTooCostly, match="the gold answer takes too long to parse"):
            equivalent(gold, "x", budget_s=1.0)
    assert len(parses) == math_answer.GOLD_PARSE_TRIES
    assert equivalent(gold, " \\frac{1}{7}+x ")  # its own text still matches


@pytest.mark.parametrize("answer", ["7", "-3.25", "1e400"])
def test_a_long_decimal_gold_answer_past_a_floats_range_matches_no_wrong_answer(answer):
    """Found beside round 3's long gold answer: a decimal gold of ~4,000 digits was infinite as
    a complex, and every answer within an infinite tolerance of it (a wrong one scored 1)."""
    gold = "9" * 3990 + ".5"
    assert not equivalent(gold, answer)
    assert equivalent(gold, gold) and equivalent(gold, "9" * 3990 + ".50")
    assert equivalent("1.5", "1.5000000000001") and not equivalent("1.5", "1.50001")
