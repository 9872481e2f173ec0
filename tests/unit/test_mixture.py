"""Several tasks in one job: prompts drawn by weight, each verified by its own task."""

import math
import random

import pytest

from groupflow.config import ConfigError
from groupflow.core.records import Prompt
from groupflow.reward_workers.scorer import Scorer
from groupflow.reward_workers.tasks import make_task
from groupflow.run.job_config import build_config

TWO = [
    {"name": "arithmetic", "label": "sums", "weight": 3},
    {"name": "arithmetic", "label": "long", "weight": 1, "options": {"terms": 5}},
]


def test_prompts_come_from_each_task_by_weight():
    rng = random.Random()
    w = rng.uniform(0.2, 5.0)
    task = make_task("mixture", {"tasks": [{**TWO[0], "weight": w}, TWO[1]]})
    n = 4000
    prompts = [p for p, _ in zip(task.train_prompts(rng.randrange(10**6)), range(n), strict=False)]
    share = sum(p.task == "sums" for p in prompts) / n
    expected = w / (w + 1)
    assert abs(share - expected) < 6 * math.sqrt(expected * (1 - expected) / n)
    assert {p.task for p in prompts} == {"sums", "long"}
    assert all(p.uid.startswith(f"{p.task}/") for p in prompts)
    # each task's own options hold: five terms, four operators
    assert all(sum(c in "+-" for c in p.text) == 4 for p in prompts if p.task == "long")


def test_each_prompt_is_verified_by_its_own_task():
    task = make_task("mixture", {"tasks": TWO})
    for prompt in task.eval_prompts(20):
        own = make_task(
            "arithmetic", next(e.get("options", {}) for e in TWO if e["label"] == prompt.task)
        )
        assert task.verify(prompt, str(prompt.answer)).reward == 1.0
        assert task.verify(prompt, str(prompt.answer + 1)).reward == own.verify(prompt, "x").reward
    stray = Prompt("x", "1+1=", 2, task="nowhere")
    assert task.verify(stray, "2").error == "error"


def test_held_out_prompts_follow_the_weights():
    task = make_task("mixture", {"tasks": TWO})
    held_out = task.eval_prompts(40)
    assert sum(p.task == "sums" for p in held_out) == 30
    assert sum(p.task == "long" for p in held_out) == 10


def test_scorer_processes_route_a_mixture_too():
    scorer = Scorer("mixture", {"tasks": TWO}, processes=1)
    try:
        prompts = make_task("mixture", {"tasks": TWO}).eval_prompts(8)
        verdicts = list(scorer.score_stream([(p, str(p.answer)) for p in prompts]))
        assert [v.reward for v in verdicts] == [1.0] * len(prompts)
    finally:
        scorer.pool.close()


@pytest.mark.parametrize(
    "tasks, message",
    [
        ([], "non-empty list"),
        ([{"name": "nope"}], "unknown task 'nope'"),
        ([{"name": "mixture"}], "unknown task 'mixture'"),
        ([{"name": "arithmetic", "weight": 0}], "positive and finite"),
        # refused by the schema's rule for every number (groupflow/config/base.py: Section)
        (
            [{"name": "arithmetic", "weight": float("inf")}],
            r"^task\.options: numbers must be finite",
        ),
        ([{"name": "arithmetic", "weight": True}], "must be a number"),
        ([{"name": "arithmetic"}, {"name": "arithmetic"}], "appears twice"),
        ([{"name": "arithmetic", "wieght": 2}], "unknown key 'wieght'"),
        (["arithmetic"], "entry 0"),
    ],
)
def test_bad_task_lists_are_one_line_config_errors(tasks, message):
    with pytest.raises(ConfigError, match=message) as err:
        build_config({"task": tasks})
    assert str(err.value).startswith(("task: ", "task.options: ")) and "\n" not in str(err.value)


def test_a_task_list_takes_overrides_of_the_task_section():
    cfg = build_config({"task": TWO}, ["task.eval_size=12", "task.system_prompt=be brief"])
    assert cfg.task.name == "mixture" and cfg.task.eval_size == 12
    assert cfg.task.options["tasks"] == TWO and cfg.task.system_prompt == "be brief"


def test_an_extra_held_out_set_scores_with_its_own_task():
    from groupflow.config import EvalSetConfig
    from groupflow.core.records import Response, SampledGroup
    from groupflow.loop.held_out import HeldOutSet

    held_out = HeldOutSet(
        EvalSetConfig(name="long", task="arithmetic", options={"terms": 4}, size=6), 5.0
    )
    try:
        assert len(held_out.prompts) == 6
        groups = [
            SampledGroup(p, [1], [Response([1], str(p.answer), []), Response([1], "x", [])], 0)
            for p in held_out.prompts
        ]
        assert held_out.rewards(groups) == [[1.0, 0.0]] * 6
    finally:
        held_out.close()


@pytest.mark.parametrize(
    "eval_sets, message",
    [
        ([{"name": "a b", "task": "arithmetic"}], "task.eval_sets.0.name"),
        ([{"name": "x", "task": "nope"}], "unknown task 'nope'"),
        (
            [{"name": "x", "task": "arithmetic"}, {"name": "x", "task": "countdown"}],
            "names must differ",
        ),
        ([{"name": "x", "task": "arithmetic", "size": 0}], "task.eval_sets.0.size"),
    ],
)
def test_bad_eval_sets_are_refused(eval_sets, message):
    with pytest.raises(ConfigError, match=message):
        build_config({"task": {"eval_sets": eval_sets}})


def test_each_task_keeps_its_own_response_limit():
    tasks = [{**TWO[0], "max_tokens": 7}, TWO[1]]
    task = make_task("mixture", {"tasks": tasks})
    prompts = [p for p, _ in zip(task.train_prompts(0), range(50), strict=False)]
    assert {p.max_tokens for p in prompts if p.task == "sums"} == {7}
    assert {p.max_tokens for p in prompts if p.task == "long"} == {None}
    assert {p.max_tokens for p in task.eval_prompts(8) if p.task == "sums"} == {7}


@pytest.mark.parametrize(
    "max_tokens, extra, message",
    [
        (0, {}, "max_tokens must be a positive integer"),
        (2.5, {}, "max_tokens must be a positive integer"),
        (3000, {}, "task sums: max_tokens \\(3000\\) must be below rollout.max_model_len"),
        (
            4,
            {"reward": {"overlong_penalty": {"buffer_tokens": 4}}},
            "buffer_tokens \\(4\\) must be below task sums",
        ),
    ],
)
def test_bad_task_limits_are_refused(max_tokens, extra, message):
    with pytest.raises(ConfigError, match=message):
        build_config({"task": [{**TWO[0], "max_tokens": max_tokens}, TWO[1]], **extra})
