"""The quickstart arithmetic task and the task registry."""

import itertools

import pytest

from groupflow.records import Prompt
from groupflow.reward_workers.tasks import TASKS, make_task
from groupflow.reward_workers.tasks.arithmetic import ArithmeticTask


def test_train_prompts_are_reproducible_and_endless():
    task = ArithmeticTask()
    first = [p.uid for p in itertools.islice(task.train_prompts(7), 500)]
    again = [p.uid for p in itertools.islice(task.train_prompts(7), 500)]
    other = [p.uid for p in itertools.islice(task.train_prompts(8), 500)]
    assert first == again
    assert first != other
    assert len(first) == 500


def test_eval_prompts_are_disjoint_from_training():
    task = ArithmeticTask()
    held_out = {p.uid for p in task.eval_prompts(50)}
    assert len(held_out) == 50
    train = {p.uid for p in itertools.islice(task.train_prompts(0), 5000)}
    assert not held_out & train


def test_prompt_answer_matches_expression():
    for prompt in itertools.islice(ArithmeticTask(digits=3, terms=4).train_prompts(1), 50):
        expr = prompt.text.rstrip("=")
        assert eval(expr) == prompt.answer  # trusted: built by the generator from digits and +-


@pytest.mark.parametrize(
    ("response", "reward"),
    [
        ("82", 1.0),
        (" 82 and some text", 1.0),
        ("81", 0.0),
        ("-82", 0.0),
        ("", 0.0),
        ("eighty-two", 0.0),
        ("８２", 1.0),  # Unicode decimal digits are digits to both re's \d and int()
        ("٨٢", 1.0),
        ("🙂82", 0.0),
        ("8" * 5000, 0.0),  # huge number: rejected without converting 5000 digits
        ("82" + "0" * 39, 0.0),
    ],
)
def test_verify(response, reward):
    verdict = ArithmeticTask().verify(Prompt("37+45", "37+45=", 82), response)
    assert verdict.reward == reward
    assert verdict.reason


def test_parse_answer_accepts_integers_only():
    task = ArithmeticTask()
    assert task.parse_answer(5) == 5
    for bad in ("5", 5.0, True, None):
        with pytest.raises(ValueError):
            task.parse_answer(bad)


def test_registry_has_every_task():
    assert set(TASKS) == {
        "arithmetic",
        "countdown",
        "knights_and_knaves",
        "math",
        "code",
        "mixture",
    }


def test_make_task_errors_name_the_culprit():
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        make_task("nope")
    with pytest.raises(ValueError, match="task.options"):
        make_task("arithmetic", {"digitz": 3})
    with pytest.raises(ValueError, match="arithmetic"):
        make_task("arithmetic", {"digits": 0})
