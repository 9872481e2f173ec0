"""Knights and knaves: puzzle logic, uniqueness, rendering, and the answer parser."""

import itertools
import random
import time

import pytest

from groupflow.core.records import Prompt
from groupflow.reward_workers.tasks.knights import (
    KnightsAndKnavesTask,
    holds,
    make_puzzle,
    read_assignment,
    render,
    solutions,
)

NAMES = ("Zoey", "Oliver", "Ethan")


def test_holds_truth_tables():
    knights = (True, False)
    a_knight, b_knight = ("is", 0, True), ("is", 1, True)
    assert holds(a_knight, knights) and not holds(b_knight, knights)
    assert holds(("not", b_knight), knights)
    assert not holds(("and", a_knight, b_knight), knights)
    assert holds(("or", a_knight, b_knight), knights)
    assert not holds(("implies", a_knight, b_knight), knights)
    assert holds(("implies", b_knight, a_knight), knights)
    assert not holds(("iff", a_knight, b_knight), knights)


def test_classic_puzzle_has_its_known_solution():
    # A says "We are both knaves": A must be a knave and B a knight.
    statements = (("and", ("is", 0, False), ("is", 1, False)), ("is", 1, True))
    assert solutions(statements) == [(False, True)]


@pytest.mark.parametrize(("people", "depth"), [(2, 2), (3, 2), (5, 3), (8, 2), (4, 4)])
def test_generated_puzzles_have_exactly_one_solution(people, depth):
    rng = random.Random(people * 10 + depth)
    for _ in range(5):
        puzzle = make_puzzle(rng, people, depth)
        assert len(puzzle.names) == len(set(puzzle.names)) == people
        assert solutions(puzzle.statements) == [puzzle.solution]
        # the stored solution really is consistent: knights tell the truth, knaves lie
        for speaker, statement in enumerate(puzzle.statements):
            assert holds(statement, puzzle.solution) == puzzle.solution[speaker]


def test_render_is_unambiguous():
    statement = ("and", ("is", 0, True), ("or", ("is", 1, False), ("not", ("is", 2, True))))
    assert (
        render(statement, NAMES)
        == "Zoey is a knight and (Oliver is a knave or Ethan is not a knight)"
    )
    assert render(("not", ("iff", ("is", 0, True), ("is", 1, True))), NAMES) == (
        "it is not the case that (Zoey is a knight if and only if Oliver is a knight)"
    )


def test_task_prompts_reproducible_disjoint_and_answerable():
    task = KnightsAndKnavesTask(people=4, depth=2)
    first = list(itertools.islice(task.train_prompts(11), 30))
    assert [p.uid for p in first] == [p.uid for p in itertools.islice(task.train_prompts(11), 30)]
    held_out = task.eval_prompts(10)
    assert len(held_out) == 10
    assert not {p.uid for p in held_out} & {
        p.uid for p in itertools.islice(task.train_prompts(0), 300)
    }
    prompt = first[0]
    assert set(prompt.answer.values()) <= {"knight", "knave"} and len(prompt.answer) == 4
    assert all(name in prompt.text for name in prompt.answer)
    perfect = (
        "<answer>" + "\n".join(f"{n} is a {r}" for n, r in prompt.answer.items()) + "</answer>"
    )
    assert task.verify(prompt, perfect).reward == 1.0


ANSWER = {"Zoey": "knight", "Oliver": "knave", "Ethan": "knight"}


@pytest.mark.parametrize(
    ("response", "reward", "reason"),
    [
        (
            "<answer>(1) Zoey is a knight\n(2) Oliver is a knave\n(3) Ethan is a knight</answer>",
            1.0,
            "correct",
        ),
        (
            "<answer>Zoey is a Knight, Oliver is a KNAVE, and Ethan is a knight.</answer>",
            1.0,
            "correct",
        ),
        ("<answer>Zoey: knight\nOliver - knave\nEthan = knight</answer>", 1.0, "correct"),
        ("<answer>Zoey and Ethan are knights; Oliver is a liar.</answer>", 1.0, "correct"),
        (
            "<answer>Zoey is a truth-teller, Oliver is not a knight, Ethan is a knight</answer>",
            1.0,
            "correct",
        ),
        (
            "<answer>**Zoey** is a **knight**, **Oliver**: *knave*, Ethan is a knight</answer>",
            1.0,
            "correct",
        ),
        (
            "If Zoey is a knave then ... so Zoey is a knight, Oliver is a knave and Ethan is a knight.",
            1.0,
            "correct",
        ),
        (
            "<answer>Zoey is a knight, Oliver is a knight, Ethan is a knight</answer>",
            0.0,
            "wrong role for Oliver",
        ),
        (
            "<answer>Zoey is a knight or a knave, Zoey is a knave, Oliver is a knave, Ethan is a knight</answer>",
            0.0,
            "hedged role for Zoey",
        ),
        (
            "<answer>Zoey is a knight, Zoey is a knave, Oliver is a knave, Ethan is a knight</answer>",
            0.0,
            "contradictory",
        ),
        ("<answer>Zoey is a knight, Oliver is a knave</answer>", 0.0, "no role given for Ethan"),
        ("", 0.0, "no role given"),
        (
            "<answer>Ｚｏｅｙ is a knight, Oliver is a knave, Ethan is a knight</answer>",
            0.0,
            "no role given for Zoey",
        ),
        ("<answer>" + "Zoey is a knight " * 2000 + "</answer>", 0.0, "no role given for Oliver"),
    ],
)
def test_verify(response, reward, reason):
    verdict = KnightsAndKnavesTask().verify(Prompt("kk", "puzzle", ANSWER), response)
    assert verdict.reward == reward
    assert reason in verdict.reason


def test_read_assignment_collects_claims_in_order():
    claims = read_assignment(
        "Zoey is a knave. Wait: Zoey is a knight. Oliver and Ethan are both knaves.", list(ANSWER)
    )
    assert claims == {"Zoey": [False, True], "Oliver": [False], "Ethan": [False]}


def test_names_do_not_match_inside_other_words():
    assert read_assignment("Leonard is a knight", ["Leo"]) == {}


def test_options_and_answers_validate():
    with pytest.raises(ValueError, match="knights_and_knaves"):
        KnightsAndKnavesTask(people=1)
    with pytest.raises(ValueError, match="knights_and_knaves"):
        KnightsAndKnavesTask(depth=1)
    task = KnightsAndKnavesTask()
    assert task.parse_answer({"A": "knight"}) == {"A": "knight"}
    for bad in ({"A": "wizard"}, {}, ["A", "knight"]):
        with pytest.raises(ValueError):
            task.parse_answer(bad)


REST = "Oliver is a knave, Ethan is a knight"
HEDGED = [
    f"<answer>Zoey is a knight or a knave, {REST}</answer>",
    f"<answer>Zoey is a knave or a knight, {REST}</answer>",
    f"<answer>Zoey is either a knight or a knave, {REST}</answer>",
    f"<answer>Zoey is maybe a knight, {REST}</answer>",
    f"<answer>Zoey is probably a knight, {REST}</answer>",
    f"<answer>Maybe Zoey is a knight, {REST}</answer>",
    f"<answer>Zoey might be a knight, {REST}</answer>",
    "<answer>Zoey: knight/knave\nOliver: knave\nEthan: knight</answer>",
    f"<answer>Zoey is a knight (or knave), {REST}</answer>",
    f"<answer>Zoey is a knight and a knave, {REST}</answer>",
    f"<answer>Zoey is a knight, Zoey is a knave, {REST}</answer>",
    f"<answer>Zoey is a knight, Zoey isn't a knight, {REST}</answer>",
    "<answer>Zoey is a knight, Oliver or Ethan is a knave, Ethan is a knight</answer>",
    "<answer>Zoey and Ethan are knights or knaves, Oliver is a knave</answer>",
    "<answer>Zoey and Ethan are probably knights, Oliver is a knave</answer>",
    "<answer>| Name | Role |\n|---|---|\n| Zoey | knight or knave |\n| Oliver | knave |\n"
    "| Ethan | knight |</answer>",
    "<answer>Zoey: knight?\nOliver: knave\nEthan: knight</answer>",
    f"<answer>Zoey is a **knight**?, {REST}</answer>",
    f"So in the end Zoey is a knight or a knave, {REST}.",  # free text: the last claim hedges
    f"Zoey is a knight. Final: Zoey is perhaps a knight, {REST}.",
]


@pytest.mark.parametrize("response", HEDGED)
def test_a_hedged_or_two_way_role_is_wrong(response):
    verdict = KnightsAndKnavesTask().verify(Prompt("kk", "puzzle", ANSWER), response)
    assert verdict.reward == 0.0, verdict.reason


RIGHT_ANSWERS = [
    "<answer>\n| Inhabitant | Role |\n|---|---|\n| Zoey | Knight |\n| Oliver | Knave |\n"
    "| Ethan | Knight |\n</answer>",
    "<answer>\n| # | Name | Role |\n|:-:|:--|:--|\n| 1 | **Zoey** | **knight** |\n"
    "| 2 | **Oliver** | **knave** |\n| 3 | **Ethan** | **knight** |\n</answer>",
    "<answer>Zoey isn't a knave, Oliver isn't a knight, Ethan isn’t a knave</answer>",
    "<answer>Zoey is not a knave; Oliver is NOT a knight; Ethan wasn't a liar</answer>",
    "<answer>Oliver is a knave. Neither Zoey nor Ethan is a knave.</answer>",
    "<answer>Neither Zoey nor Ethan is a liar, and Oliver isn't a truth-teller.</answer>",
    "<answer>Zoey and Ethan aren't knaves; Oliver is a knave.</answer>",
    "<answer>Zoey and Ethan are not liars, but Oliver must be a knave.</answer>",
    "<answer>Zoey, Ethan are both knights. Oliver: knave.</answer>",
    "<answer>Both Zoey and Ethan are knights, while Oliver is definitely a knave.</answer>",
    "If Zoey were a knave ... Therefore neither Zoey nor Ethan is a knave, and Oliver is a knave.",
    "<answer>Zoey is a knight, not a knave. Oliver is a knave. Ethan is a knight.</answer>",
    "<answer>Zoey: Knight (truth-teller)\nOliver: Knave (liar)\nEthan: Knight</answer>",
    "<answer>Zoey is a knight and Oliver is a knave and Ethan is a knight</answer>",
    "Is Zoey a knave or a knight? Check both. So Zoey is a knight, Oliver is a knave, Ethan is a knight.",
]


@pytest.mark.parametrize("response", RIGHT_ANSWERS)
def test_right_roles_in_tables_contractions_and_group_statements_score_one(response):
    verdict = KnightsAndKnavesTask().verify(Prompt("kk", "puzzle", ANSWER), response)
    assert verdict.reward == 1.0, verdict.reason


def test_group_statements_read_as_claims_about_each_person():
    names = list(ANSWER)
    assert read_assignment("Neither Zoey nor Oliver is a knight.", names) == {
        "Zoey": [False],
        "Oliver": [False],
    }
    assert read_assignment("Zoey and Ethan aren't knights", names) == {
        "Zoey": [False],
        "Ethan": [False],
    }
    assert read_assignment("Zoey or Oliver is a knight", names) == {"Oliver": [None]}


@pytest.mark.parametrize(
    "unit", ["Zoey, ", "Zoey and ", "Zoey, and ", "neither Zoey nor ", "Zoey is maybe ", "Zoey | "]
)
def test_reading_claims_is_linear(unit):
    # A run of names was rescanned from each name in it: 2.5 s on a 20,000-character answer.
    response = "<answer>" + unit * (20_000 // len(unit)) + "</answer>"
    start = time.perf_counter()
    verdict = KnightsAndKnavesTask().verify(Prompt("kk", "puzzle", ANSWER), response)
    assert verdict.reward == 0.0
    assert time.perf_counter() - start < 0.5
