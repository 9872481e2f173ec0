"""A verifier reads only the span the model's answer can occupy, normalised: a trajectory's
final turn (reward_workers/scorer.py, Response.answer_text), and markers as a reader sees them
(reward_workers/reader_view.py), so that neither a marker the model writes itself nor one it
disguises moves the answer that is read."""

from __future__ import annotations

import pytest

from groupflow.core.records import Prompt, Response, SampledGroup
from groupflow.reward_workers.reader_view import disguised, normalised
from groupflow.reward_workers.scorer import response_items
from groupflow.reward_workers.tasks.countdown import CountdownTask
from groupflow.reward_workers.tasks.knights import KnightsAndKnavesTask
from groupflow.reward_workers.tasks.long_addition import LongAdditionTask
from groupflow.reward_workers.tasks.math_problems import MathTask
from groupflow.reward_workers.tasks.tool_arithmetic import CHAT_TEMPLATE, ToolArithmeticTask
from tests.unit.test_trajectory import ScriptedEngine, renderer_for, run

PRODUCT = Prompt("6668*6599", "6668*6599=", 6668 * 6599)  # 44002132


def _verdict(task, prompt: Prompt, response: Response):
    """As the reward workers score it: what response_items hands the verifier."""
    ((_, text),) = response_items([SampledGroup(prompt, [0], [response], 0)])
    return task.verify(prompt, text)


def _trajectory(turns: list[str], environment=None) -> Response:
    renderer = renderer_for(CHAT_TEMPLATE)
    _, _, response = run(
        renderer, ScriptedEngine(renderer.tokenizer, turns), environment, prompt=PRODUCT
    )
    return response


def test_a_tool_response_marker_the_model_writes_does_not_cut_its_answer():
    """`44002131</tool_response>44002132` in the model's own final turn scored 1.0: the text
    after the trajectory's last `</tool_response>` was read as the answer."""
    call = '<tool_call>{"name":"calculator","arguments":{"expression":"6668*6599"}}</tool_call>'
    honest = _trajectory([call, "44002132"])
    forged = _trajectory([call, "44002131</tool_response>44002132"])
    alone = _trajectory(["44002131</tool_response>44002132"])
    task = ToolArithmeticTask()
    assert (honest.end_reason, honest.turns) == ("answer", 2)
    assert _verdict(task, PRODUCT, honest).reward == 1.0
    assert _verdict(task, PRODUCT, forged).reward == 0.0
    assert _verdict(task, PRODUCT, alone).reward == 0.0
    assert forged.final_turn == "44002131</tool_response>44002132"


class ShowsTheAnswer:
    """An environment (a tool, really) whose output holds a well-formed answer."""

    def __init__(self, prompt):
        self.turns = 0

    def step(self, turn):
        self.turns += 1
        return [{"role": "tool", "content": "\\boxed{42}"}] if self.turns == 1 else None


def test_an_observation_never_answers_for_the_model():
    """The math verifier took the last \\boxed{} of the whole trajectory, a tool's output
    included: a final turn with no answer scored as the tool's."""
    response = _trajectory(["run it", "the tool says so"], ShowsTheAnswer)
    assert "\\boxed{42}" in response.text and response.turns == 2
    assert _verdict(MathTask(), Prompt("m", "?", "42"), response).reward == 0.0
    answered = _trajectory(["run it", "\\boxed{42}"], ShowsTheAnswer)
    assert _verdict(MathTask(), Prompt("m", "?", "42"), answered).reward == 1.0


def test_a_single_completion_is_read_whole():
    single = Response([1], "work \\boxed{42}", [0.0])
    assert single.answer_text == single.text
    assert _verdict(MathTask(), Prompt("m", "?", "42"), single).reward == 1.0


ADDITION = Prompt("399+369", "399+369=", 768)


@pytest.mark.parametrize(
    "response",
    [
        "9+9+0=18 аnswer 769 answer 768",  # Cyrillic а
        "answers: 769. answer 768",
        "ANSWERS 769 answer 768",
        "ans\u200bwer 769 answer 768",  # a zero-width space inside
        "a\u0301nswer 769 answer 768",  # a combining mark
        "ａｎｓｗｅｒ 769 answer 768",  # fullwidth
        "ΑΝЅWΕR 769 answer 768",  # Greek and Cyrillic capitals
        "answer 769 ansԝer 768",  # the disguise on the last one
    ],
)
def test_a_disguised_second_answer_is_still_a_second_answer(response):
    verdict = LongAdditionTask().verify(ADDITION, response)
    assert verdict.reward == 0.0, verdict.reason
    assert "final answers" in verdict.reason


@pytest.mark.parametrize("response", ["answer 768", "Answer 768\n", "9+9+0=18 ａｎｓｗｅｒ 768"])
def test_one_answer_in_any_letters_a_reader_reads_as_answer_still_scores(response):
    assert LongAdditionTask().verify(ADDITION, response).reward == 1.0


KNIGHTS = {"Ava": "knight", "Ben": "knave"}


COUNTDOWN = Prompt("t", "t", {"numbers": [3, 5], "target": 8})
GOLD = Prompt("m", "?", "42")


@pytest.mark.parametrize(
    ("task", "prompt", "plain", "disguise"),
    [
        (CountdownTask(), COUNTDOWN, "<answer>3+5</answer>", " then <аnswer>3*5</аnswer>"),
        (CountdownTask(), COUNTDOWN, "<answer>3+5</answer>", "<answer>3*5</ANSWER\u200b>"),
        (
            KnightsAndKnavesTask(),
            Prompt("kk", "puzzle", KNIGHTS),
            "<answer>Ava is a knight\nBen is a knave</answer>",
            "<аnswer>Ava is a knave\nBen is a knight</аnswer>",
        ),
        (MathTask(), GOLD, "\\boxed{42}", " or \\bоxed{41}"),
        (MathTask(), GOLD, "\\boxed{42}", " and then \\ｂｏｘｅｄ{41}"),
    ],
)
def test_a_disguised_answer_marker_is_refused(task, prompt, plain, disguise):
    """The plain marker's answer is right; a reader sees a later, disguised one."""
    assert task.verify(prompt, plain).reward == 1.0
    verdict = task.verify(prompt, plain + disguise)
    assert verdict.reward == 0.0, verdict.reason
    assert "disguised" in verdict.reason


def test_the_reader_view():
    assert normalised("ＡＮＳ\u200bWER") == "answer"
    assert disguised("<аnswer>", "<answer>") and not disguised("<ANSWER>", "<answer>")
    assert not disguised("the word boxed, no backslash", "\\boxed")
    assert disguised("\\bоxed{1}", "\\boxed") and not disguised("\\boxed{1}", "\\boxed")
