"""What the built-in model's warm start (groupflow/run/quickstart.py) trains on for each task:
the task's own demonstration, or its bare answer when that is text; a task whose answers are
records is refused in one line before anything is built."""

from __future__ import annotations

from dataclasses import replace

import pytest

from groupflow.reward_workers.tasks import make_task
from groupflow.reward_workers.tasks.base import demonstration_turns
from groupflow.reward_workers.tasks.mixture import MixtureTask
from groupflow.run.quickstart import quickstart_model_path
from tests.unit.test_verifiers_multi_turn import TWO_TURNS, taskset  # noqa: F401 (a fixture)


def _first(task):
    return next(task.train_prompts(seed=3))


@pytest.mark.parametrize("name", ["code", "countdown", "knights_and_knaves"])
def test_a_task_whose_answers_are_records_is_refused_before_the_build(name, tmp_path, monkeypatch):
    monkeypatch.setenv("GROUPFLOW_CACHE", str(tmp_path))
    with pytest.raises(ValueError) as err:
        quickstart_model_path(name, {}, warm_start_steps=1, progress=False)
    (line,) = str(err.value).splitlines()
    assert line.startswith(f"task.name: {name}: the built-in model (model.path unset)")
    assert line.endswith("set model.path to a model of your own")
    assert list(tmp_path.iterdir()) == []  # nothing built, nothing written


@pytest.mark.parametrize("name", ["arithmetic", "math"])
def test_a_task_with_text_answers_demonstrates_the_bare_answer(name):
    prompt = _first(make_task(name, {}))
    assert demonstration_turns(make_task(name, {}), prompt) == [
        (str(prompt.answer), True),
        ("", True),
    ]


def test_a_mixture_demonstrates_each_prompt_as_its_own_task_does():
    spec = [{"name": "long_addition"}, {"name": "arithmetic"}]
    mixture = MixtureTask(spec)
    seen = set()
    for prompt, _ in zip(mixture.train_prompts(seed=5), range(40), strict=False):
        (text, trained), end = demonstration_turns(mixture, prompt)
        member = mixture.tasks[prompt.task]
        assert end == ("", True) and trained
        own = replace(prompt, uid=prompt.uid.split("/", 1)[1])
        assert (text, trained) == demonstration_turns(member, own)[0]
        if prompt.task == "long_addition":
            assert text.endswith(f"answer {prompt.answer}") and " " in text  # worked, not bare
        else:
            assert text == str(prompt.answer)
        seen.add(prompt.task)
    assert seen == {"long_addition", "arithmetic"}


def test_a_verifiers_taskset_demonstrates_its_datas_answer_not_its_row(taskset):  # noqa: F811
    task = make_task(f"verifiers:{taskset()}", {"count": 10})
    prompt = _first(task)
    assert demonstration_turns(task, prompt) == [
        (prompt.answer["data"]["answer"], True),
        ("", True),
    ]
    without = make_task(f"verifiers:{taskset(TWO_TURNS.replace('answer', 'gold'))}", {})
    with pytest.raises(
        ValueError, match=r"^task.name: verifiers:\w+: the built-in model .*`answer`"
    ):
        demonstration_turns(without, _first(without))


def test_a_multi_turn_taskset_builds_the_built_in_model_with_a_chat_template(
    taskset,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """Its program's turns are rendered by the model's template: the built-in model has one."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("GROUPFLOW_CACHE", str(tmp_path))
    name = f"verifiers:{taskset()}"
    built = quickstart_model_path(name, {"count": 10}, warm_start_steps=1, progress=False)
    template = AutoTokenizer.from_pretrained(built).chat_template
    assert template == make_task(name, {"count": 10}).CHAT_TEMPLATE
