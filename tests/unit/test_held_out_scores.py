"""Held-out scores have one home (groupflow/loop/held_out.py: held_out_scores), which a training
job's evaluation and `groupflow eval` both call; here with answers and rewards made up."""

from __future__ import annotations

import pytest

from groupflow.core.records import Prompt, Response, SampledGroup
from groupflow.loop.held_out import held_out_scores
from groupflow.run.evaluate import eval_keys


def _prompts(tasks: list[str | None]) -> list[Prompt]:
    return [Prompt(f"p{i}", f"q{i}", i, task=task) for i, task in enumerate(tasks)]


def _answerer(prompts: list[Prompt], n: int, asked: list[bool]):
    def answers(greedy: bool) -> list[SampledGroup]:
        asked.append(greedy)
        count = 1 if greedy else n
        return [
            SampledGroup(p, [1], [Response([1], str(i), []) for i in range(count)], 0)
            for p in prompts
        ]

    return answers


def _reward_even_prompts_and_first_samples(groups: list[SampledGroup]) -> list[list[float]]:
    """Greedy: prompts of even answer pass. Sampled: the first two samples of those pass."""
    return [
        [
            float(g.prompt.answer % 2 == 0 and (len(g.responses) == 1 or i < 2))
            for i in range(len(g.responses))
        ]
        for g in groups
    ]


def test_greedy_then_sampled_scores_by_task_with_what_is_under_way():
    prompts = _prompts(["even", "odd", "even", "odd"])
    asked, notes = [], []
    scores = held_out_scores(
        prompts,
        _answerer(prompts, 4, asked),
        _reward_even_prompts_and_first_samples,
        samples=4,
        pass_k=2,
        doing=lambda note: notes.append(note),
        of="the task",
    )
    assert asked == [True, False]  # greedy first
    assert scores["accuracy"] == 0.5
    assert scores["task_accuracy"] == {"even": 1.0, "odd": 0.0}
    # two of four prompts pass 2 of 4 samples: mean@4 = 1/4; pass@2 = (5/6) / 2
    assert scores["mean_at_n"] == pytest.approx(0.25)
    assert scores["pass_at_k"] == pytest.approx(5 / 12)
    assert notes == [
        "greedy answers to 4 prompts of the task",
        "4 sampled answers to 4 prompts of the task",
    ]


def test_greedy_only_for_one_task_and_groupflow_evals_names():
    prompts = _prompts([None, None, None])
    asked, notes = [], []
    scores = held_out_scores(
        prompts,
        _answerer(prompts, 0, asked),
        _reward_even_prompts_and_first_samples,
        samples=0,
        pass_k=None,
        doing=lambda note: notes.append(note),
    )
    assert asked == [True] and scores == {"accuracy": pytest.approx(2 / 3)}
    assert notes == ["greedy answers to 3 prompts"]  # groupflow eval's, of no set
    sampled = {"accuracy": 0.5, "mean_at_n": 0.25, "pass_at_k": 0.4}
    assert eval_keys(sampled, 4, 2) == {"accuracy": 0.5, "mean@4": 0.25, "pass@2": 0.4}
