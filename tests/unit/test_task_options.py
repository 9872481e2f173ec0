"""Task options checked at config time against each task's own declaration (its constructor):
a misspelt or ill-typed option is one line naming the key, before anything is built."""

from __future__ import annotations

import inspect

import pytest

from groupflow.config import ConfigError
from groupflow.reward_workers.tasks import TASKS, check_options, make_task, task_options
from groupflow.run.cli import main
from groupflow.run.job_config import build_config


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("groupflow: error: "), err
    return err.removeprefix("groupflow: error: ").strip()


def test_a_misspelt_option_is_named_with_the_known_ones_and_the_nearest(capsys):
    assert main(["config", "--set", "task.name=math", "--set", "task.options.datset=d.jsonl"]) == 2
    line = one_error_line(capsys)
    assert line.startswith("task.options.datset: unknown option of task math; known: dataset, ")
    assert "instruction" in line and "format_weight" in line
    assert line.endswith("did you mean dataset?")
    assert "__init__" not in line and "keyword argument" not in line


def test_an_option_of_the_wrong_type_is_named(capsys):
    assert main(["config", "--set", "task.options.digits='3'"]) == 2
    assert (
        one_error_line(capsys) == "task.options.digits: input should be a valid integer (got '3')"
    )
    with pytest.raises(ConfigError, match=r"^task\.options\.fields\.prompt: .*string \(got 3\)$"):
        build_config({"task": {"name": "math", "options": {"fields": {"prompt": 3}}}})


def test_a_mixture_entry_and_a_held_out_set_are_named_by_their_place():
    tasks = [{"name": "arithmetic"}, {"name": "math", "options": {"timeout": 3}}]
    with pytest.raises(
        ConfigError,
        match=r"^task\[1\]\.options\.timeout: unknown option of task math.*did you mean timeout_s\?$",
    ):
        build_config({"task": tasks})
    eval_sets = [
        {"name": "a", "task": "arithmetic"},
        {"name": "b", "task": "countdown", "options": {"count": 2.5}},
    ]
    with pytest.raises(
        ConfigError, match=r"^task\.eval_sets\[1\]\.options\.count: input should be a valid integer"
    ):
        build_config({"task": {"eval_sets": eval_sets}})


def test_an_unknown_task_is_refused_at_config_time():
    with pytest.raises(ConfigError, match=r"^task\.name: unknown task 'maths'"):
        build_config({"task": {"name": "maths"}})


def test_a_task_built_elsewhere_is_checked_the_same_way():
    # reward workers and `groupflow score` build tasks by name: the same one line
    with pytest.raises(
        ValueError, match=r"^task\.options\.digitz: unknown option of task arithmetic"
    ):
        make_task("arithmetic", {"digitz": 2})


@pytest.mark.parametrize("name", sorted(set(TASKS) - {"mixture"}))
def test_every_task_declares_each_option_with_a_type_its_default_has(name):
    options = task_options(name)
    assert options, name
    for option in options.values():
        assert option.annotation is not inspect.Parameter.empty, (name, option.name)
    # The defaults pass the declared types, so the check refuses nothing a task accepts by default.
    check_options(name, {k: p.default for k, p in options.items()}, "task.options")


def test_good_options_pass():
    cfg = build_config(
        {
            "task": [
                {"name": "math", "options": {"timeout_s": 3, "skip_prompts": ["a"]}},
                {"name": "arithmetic", "options": {"digits": 2}},
            ]
        }
    )
    assert cfg.task.options["tasks"][0]["options"]["timeout_s"] == 3


def test_a_wrong_part_inside_a_union_is_named_by_its_place_in_the_value():
    from collections.abc import Mapping

    from groupflow.reward_workers.tasks import _type_problem

    # pydantic puts the union member's name in the error's location; the key is the value's own
    assert _type_problem(Mapping[str, str] | str | None, {"a": 1}) == (
        ".a",
        "input should be a valid string",
        1,
    )
    assert _type_problem(list[dict[str, int]], [{"x": 1}, {"y": "z"}])[0] == "[1].y"
