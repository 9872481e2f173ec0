"""The long_addition task: seeded generation, the scratchpad it teaches, and its verifier."""

import itertools
import random

import pytest

from groupflow.core.records import Prompt
from groupflow.reward_workers.tasks import make_task
from groupflow.reward_workers.tasks.long_addition import (
    SEPARATORS,
    LongAdditionTask,
    scratchpad,
    separator,
)


def test_train_prompts_are_reproducible_and_differ_by_seed():
    task = LongAdditionTask()
    first = [p.uid for p in itertools.islice(task.train_prompts(7), 300)]
    assert first == [p.uid for p in itertools.islice(task.train_prompts(7), 300)]
    assert first != [p.uid for p in itertools.islice(task.train_prompts(8), 300)]


def test_eval_prompts_are_disjoint_from_training():
    task = LongAdditionTask(digits=3)
    held_out = {p.uid for p in task.eval_prompts(100)}
    assert len(held_out) == 100
    assert not held_out & {p.uid for p in itertools.islice(task.train_prompts(0), 5000)}


@pytest.mark.parametrize("digits", [1, 4, 7, 24])
def test_prompts_have_the_right_operands_and_answer(digits):
    for prompt in itertools.islice(LongAdditionTask(digits=digits).train_prompts(digits), 50):
        a, b = prompt.text.removesuffix("=").split("+")
        assert len(a) == len(b) == digits and a[0] != "0" and b[0] != "0"
        assert prompt.answer == int(a) + int(b)


def test_scratchpad_columns_are_the_schoolbook_sum_on_random_operands():
    """Each column's digits are the operands' digits from the right, its carry-in the previous
    column's carry-out, its two-digit sum theirs; the answer is the true sum, whatever the
    separators."""
    rng = random.Random(0)
    for _ in range(500):
        a, b = rng.randrange(10 ** rng.randint(1, 30)), rng.randrange(10 ** rng.randint(1, 30))
        width = max(len(str(a)), len(str(b)))
        worked = scratchpad(a, b, [rng.random() for _ in range(width)])
        for sep, _ in SEPARATORS:
            worked = worked.replace(sep, " ")
        *columns, marker, answer = worked.split(" ")
        assert marker == "answer" and int(answer) == a + b
        assert len(columns) == max(len(str(a)), len(str(b)))
        carry = 0
        for i, column in enumerate(columns):
            terms, total = column.split("=")
            x, y, c = (int(t) for t in terms.split("+"))
            assert x == a // 10**i % 10 and y == b // 10**i % 10 and c == carry
            assert len(total) == 2 and int(total) == x + y + c
            carry = int(total[0])
        assert carry == (a + b) // 10 ** len(columns)


def test_separators_are_drawn_with_their_shares():
    assert sum(share for _, share in SEPARATORS) == pytest.approx(1.0)
    rng = random.Random(4)
    n = 200_000
    drawn = [separator(rng.random()) for _ in range(n)]
    for text, share in SEPARATORS:
        assert abs(drawn.count(text) / n - share) < 4 * (share / n) ** 0.5 + 1e-4
    assert scratchpad(473, 295) == "3+5+0=08 7+9+0=16 4+2+1=07 answer 768"


def test_demonstrations_are_seeded_by_the_prompt_and_sometimes_vary_harmlessly():
    task = LongAdditionTask()
    prompts = list(itertools.islice(task.train_prompts(1), 3000))
    shown = [task.demonstration(p) for p in prompts]
    assert shown == [task.demonstration(p) for p in prompts]
    varied = [s for s in shown if any(c in s for c in ",.()*/")]
    assert 0 < len(varied) < 0.1 * len(shown)
    assert all(task.verify(p, s).reward == 1.0 for p, s in zip(prompts, shown, strict=True))


def test_the_demonstration_scores_one_and_fits_the_long_response_range():
    task = LongAdditionTask(digits=4)
    for prompt in itertools.islice(task.train_prompts(3), 50):
        shown = task.demonstration(prompt)
        assert 40 <= len(shown) <= 60  # characters = tokens of the built-in tokenizer
        assert task.verify(prompt, shown).reward == 1.0


PROMPT = Prompt("4738+2956", "4738+2956=", 7694)
WORK = "8+6+0=14 3+5+1=09 7+9+0=16 4+2+1=07 "


@pytest.mark.parametrize(
    "response",
    [
        WORK + "answer 7694",
        WORK + "answer 7694\n",
        "answer 7694",  # the scratchpad is not checked
        WORK + "answer 07694",
        "garbage 1+1=3 answer 7694",  # nor is a wrong scratchpad
        WORK + "Answer 7694",
        WORK + "answer ７６９４",  # Unicode decimal digits are digits
    ],
)
def test_one_final_answer_is_accepted(response):
    verdict = LongAdditionTask().verify(PROMPT, response)
    assert verdict.reward == 1.0, verdict.reason


@pytest.mark.parametrize(
    "response",
    [
        "",
        WORK,  # no final answer
        "7694",
        WORK + "answer 7695",
        WORK + "answer -7694",
        WORK + "answer 7694 or 7695",
        WORK + "answer 7694 answer 7695",
        WORK + "answer 7695 answer 7694",
        "answer 7694 " + WORK + "answer 7694",  # said twice is two answers
        WORK + "answer 7694/7695",
        WORK + "answer 7694?",
        WORK + "answer 7694.5",
        WORK + "answer 7,694",
        WORK + "answer 7694 maybe",
        WORK + "answer about 7694",
        WORK + "answer 7694 (or 7695)",
        WORK + "answer 76940",
        WORK + "answer " + "7694" * 5000,  # huge: compared as text, never converted
        WORK + "answer\n7694",
        WORK + "answers 7694",
    ],
)
def test_hostile_or_wrong_answers_score_zero(response):
    verdict = LongAdditionTask().verify(PROMPT, response)
    assert verdict.reward == 0.0, verdict.reason
    assert verdict.reason and len(verdict.reason) < 200


@pytest.mark.parametrize("digits", [30, 300, 4000])
def test_long_answers_are_compared_exactly(digits):
    answer = int("9" * digits)
    prompt = Prompt("big", "?", answer)
    task = LongAdditionTask()
    assert task.verify(prompt, f"answer {answer}").reward == 1.0
    assert task.verify(prompt, f"answer {answer - 1}").reward == 0.0
    assert task.verify(prompt, f"answer {answer}0").reward == 0.0


def test_options_and_answers_are_validated_in_one_line():
    with pytest.raises(ValueError, match="long_addition: digits"):
        make_task("long_addition", {"digits": 0})
    with pytest.raises(ValueError, match="long_addition: digits"):
        make_task("long_addition", {"digits": 25})
    with pytest.raises(ValueError, match="task.options"):
        make_task("long_addition", {"terms": 3})
    task = LongAdditionTask()
    assert task.parse_answer(12) == 12
    for bad in ("12", 12.0, True, -1, None):
        with pytest.raises(ValueError):
            task.parse_answer(bad)
