"""Environment packages as tasks (docs/environments.md): reasoning-gym's datasets and verifiers'
tasksets, their rows and their rewards through the task registry, as the reward workers build
them. Both packages are in the `envs` extra that `dev` brings, so nothing here skips."""

from __future__ import annotations

import itertools
import os
import random
import textwrap
import uuid

import pytest

from groupflow.config import ConfigError
from groupflow.reward_workers.scorer import Scorer
from groupflow.reward_workers.tasks import make_task
from groupflow.run.job_config import build_config

CHAIN_SUM = {"min_terms": 2, "max_terms": 3, "max_digits": 2}


def _seed() -> int:
    return random.randrange(2**31)


# ----- reasoning-gym --------------------------------------------------------------------------


@pytest.mark.parametrize("answer_format", ["plain", "tags"])
def test_reasoning_gym_rows_score_1_when_right_and_0_when_wrong(answer_format):
    task = make_task("reasoning_gym:chain_sum", {**CHAIN_SUM, "answer_format": answer_format})
    prompts = list(itertools.islice(task.train_prompts(_seed()), 20))
    assert len({p.uid for p in prompts}) > 10  # rows of the generator, not one repeated
    for prompt in prompts:
        gold = prompt.answer["answer"]
        assert prompt.text.startswith(prompt.answer["question"])
        right = gold if answer_format == "plain" else f"so <answer>{gold}</answer>"
        wrong = str(int(gold) + 1)
        wrong = wrong if answer_format == "plain" else f"<answer>{wrong}</answer>"
        assert task.verify(prompt, right).reward == 1.0
        assert task.verify(prompt, wrong).reward == 0.0
        assert task.demonstration(prompt) == (
            right if answer_format == "plain" else f"<answer>{gold}</answer>"
        )
    if answer_format == "tags":  # the answer must be where the instruction says
        assert task.verify(prompts[0], prompts[0].answer["answer"]).reward == 0.0


def test_reasoning_gym_partial_scores_stay_partial():
    # reasoning-gym's default scoring gives len(gold) / len(answer) to an answer holding the
    # gold one (spell_backward's own scoring, used here before, accepts some such answers whole)
    task = make_task("reasoning_gym:chain_sum", {"answer_format": "plain"})
    for prompt in itertools.islice(task.train_prompts(_seed()), 20):
        gold = prompt.answer["answer"]
        # a letter, not a digit: "00" is the number 0 and scores whole when the gold answer is 0
        verdict = task.verify(prompt, f"{gold}x")
        assert verdict.reward == len(gold) / (len(gold) + 1) and verdict.error is None


def test_reasoning_gym_held_out_rows_are_never_trained_on_and_the_stream_repeats_from_its_seed():
    task = make_task("reasoning_gym:chain_sum", {"max_terms": 2, "max_digits": 1})
    held_out = {p.uid for p in task.eval_prompts(10)}
    assert held_out
    seed = _seed()
    train = [p.uid for p in itertools.islice(task.train_prompts(seed), 2000)]
    assert not held_out & set(train)
    again = make_task("reasoning_gym:chain_sum", {"max_terms": 2, "max_digits": 1})
    assert [p.uid for p in itertools.islice(again.train_prompts(seed), 50)] == train[:50]
    assert {p.uid for p in again.eval_prompts(10)} == held_out


def test_a_bad_reasoning_gym_name_or_option_is_one_line_naming_it():
    with pytest.raises(ConfigError) as err:
        build_config({"task": {"name": "reasoning_gym:chain_sun"}})
    message = str(err.value)
    assert "\n" not in message
    assert "unknown reasoning-gym dataset 'chain_sun'; did you mean chain_sum?" in message
    assert "import reasoning_gym.factory" in message  # how to list the valid names
    with pytest.raises(ConfigError, match=r"task.options.max_term: unknown option .*max_terms"):
        build_config({"task": {"name": "reasoning_gym:chain_sum", "options": {"max_term": 3}}})
    with pytest.raises(ValueError, match="refused its config: max_terms must be >= min_terms"):
        make_task("reasoning_gym:chain_sum", {"min_terms": 4, "max_terms": 2})
    with pytest.raises(ConfigError, match="names no package task"):
        build_config({"task": {"name": "reasoning_gm:chain_sum"}})


def test_a_reasoning_gym_task_mixes_with_the_built_in_ones_and_makes_a_held_out_set():
    cfg = build_config(
        {"task": [{"name": "arithmetic"}, {"name": "reasoning_gym:chain_sum", "label": "rg"}]}
    )
    task = make_task(cfg.task.name, cfg.task.options)
    prompt = next(p for p in task.train_prompts(_seed()) if p.task == "rg")
    assert task.verify(prompt, f"<answer>{prompt.answer['answer']}</answer>").reward == 1.0
    # and as an extra held-out set, checked alike
    held_out = {"eval_sets": [{"name": "rg", "task": "reasoning_gym:gcd", "size": 4}]}
    assert build_config({"task": held_out}).task.eval_sets[0].task == "reasoning_gym:gcd"
    held_out["eval_sets"][0]["task"] = "reasoning_gym:gdc"
    with pytest.raises(ConfigError, match="did you mean gcd"):
        build_config({"task": held_out})


# ----- verifiers ------------------------------------------------------------------------------

TASKSET = """
import verifiers.v1 as vf

class SumData(vf.TaskData):
    answer: str

class SumTask(vf.Task[SumData]):
    @vf.reward(weight=3.0)
    async def correct(self, task, trace) -> float:
        return 1.0 if trace.last_reply.strip() == task.answer else 0.0

    @vf.reward
    async def sees_the_system_prompt(self, trace) -> float:
        return 1.0 if trace.messages[0].role == "system" else 0.0

class SumsConfig(vf.TasksetConfig):
    count: int = 200

class SumsTaskset(vf.Taskset[SumTask, SumsConfig]):
    def load(self):
        for i in range(self.config.count):
            a, b = divmod(i, 10)
            shot = [vf.UserMessage(content="1+1="), vf.AssistantMessage(content="2")]
            prompt = [*shot, vf.UserMessage(content=f"{a}+{b}=")]
            yield SumTask(
                SumData(prompt=prompt, answer=str(a + b), system_prompt="Add."),
                self.config.task,
            )
"""


@pytest.fixture
def taskset(tmp_path, monkeypatch):
    """A verifiers taskset package written here, installed on the path; its id."""

    def write(source: str, exports: str) -> str:
        name = f"sums_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source) + f"\n__all__ = {exports}\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        return name

    return write


def test_a_single_turn_taskset_gives_its_rows_and_its_rubric_scores(taskset):
    name = taskset(TASKSET, '["SumsTaskset"]')
    task = make_task(f"verifiers:{name}", {"count": 100})
    prompts = list(itertools.islice(task.train_prompts(_seed()), 200))
    held_out = task.eval_prompts(200)
    # about a tenth held out, by a hash of each task: every task in one set or the other
    assert 3 <= len(held_out) <= 20 and not {p.uid for p in held_out} & {p.uid for p in prompts}
    assert len({p.uid for p in prompts}) + len(held_out) == 100
    prompt = prompts[0]
    # the taskset's system prompt and few-shot turns, as the chat template renders them
    assert [m["role"] for m in prompt.messages] == ["system", "user", "assistant", "user"]
    assert prompt.messages[0]["content"] == "Add." and prompt.messages[2]["content"] == "2"
    gold = prompt.answer["answer"]
    right, wrong = task.verify(prompt, gold), task.verify(prompt, gold + "1")
    # the weighted mean of its rewards: (3 * 1 + 1 * 1) / 4 and (3 * 0 + 1 * 1) / 4
    assert (right.reward, wrong.reward) == (1.0, 0.25)
    assert "correct 1" in right.reason and right.error is None


def test_a_taskset_takes_its_config_and_a_held_out_config(taskset):
    name = taskset(TASKSET, '["SumsTaskset"]')
    task = make_task(f"verifiers:{name}", {"count": 30, "eval_taskset": {"count": 5}})
    assert [p.messages[-1]["content"] for p in task.eval_prompts(100)] == [
        "0+0=", "0+1=", "0+2=", "0+3=", "0+4=",
    ]  # fmt: skip
    assert len({p.uid for p in itertools.islice(task.train_prompts(_seed()), 30)}) == 30
    with pytest.raises(ConfigError, match=r"task.options.cuont: unknown option .*count"):
        build_config({"task": {"name": f"verifiers:{name}", "options": {"cuont": 3}}})
    with pytest.raises(ValueError, match=r"task.options.eval_taskset.count: .*valid integer"):
        make_task(f"verifiers:{name}", {"eval_taskset": {"count": "many"}})


def test_a_scoring_failure_is_a_verifier_error_not_a_wrong_answer(taskset):
    failing = TASKSET.replace(
        'return 1.0 if trace.messages[0].role == "system" else 0.0', "raise RuntimeError('down')"
    )
    name = taskset(failing, '["SumsTaskset"]')
    task = make_task(f"verifiers:{name}", {})
    prompt = next(task.train_prompts(_seed()))
    verdict = task.verify(prompt, prompt.answer["answer"])
    assert (verdict.reward, verdict.error) == (0.0, "error")
    assert "down" in verdict.reason


def test_a_multi_turn_taskset_is_refused_in_one_line_saying_why(taskset):
    with_env = TASKSET + textwrap.dedent(
        """
        class Turns(vf.Env[vf.EnvConfig]):
            async def run(self, task, agents):
                await agents.agent.run(task)
        """
    )
    name = taskset(with_env, '["SumsTaskset", "Turns"]')
    with pytest.raises(ValueError) as err:
        make_task(f"verifiers:{name}", {})
    message = str(err.value)
    assert "\n" not in message
    assert f"verifiers:{name} is a multi-turn taskset (it ships an Env of its own)" in message
    assert "OpenAI-compatible rollout endpoint" in message


def test_a_missing_taskset_is_one_line():
    with pytest.raises(ConfigError) as err:
        build_config({"task": {"name": "verifiers:no_such_taskset_here"}})
    assert "\n" not in str(err.value)
    assert "no verifiers taskset 'no_such_taskset_here'" in str(err.value)


def test_the_reward_workers_scorer_processes_score_both_packages(taskset, tmp_path, monkeypatch):
    """Through a scorer process (reward_workers/verifier_child.py), as a reward worker scores:
    the process builds the job's task by name and scores what the driver's stream drew."""
    name = taskset(TASKSET, '["SumsTaskset"]')
    inherited = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), inherited])))
    entries = [
        {"name": "reasoning_gym:chain_sum", "options": {**CHAIN_SUM, "answer_format": "plain"}},
        {"name": f"verifiers:{name}", "label": "sums"},
    ]
    scorer = Scorer("mixture", {"tasks": entries}, processes=1)
    try:
        stream = scorer.task.train_prompts(_seed())
        drawn = {p.task: p for p in itertools.islice(stream, 50)}
        rg, sums = drawn["reasoning_gym:chain_sum"], drawn["sums"]
        items = [
            (rg, rg.answer["answer"]),
            (rg, str(int(rg.answer["answer"]) + 1)),
            (rg, rg.answer["answer"] + "x"),  # holds the gold answer: a partial score
            (sums, sums.answer["answer"]),
            (sums, "nine"),
        ]
        rewards = [v.reward for v in scorer.pool.verify_all(items)]
    finally:
        scorer.close()
    assert rewards[:2] + rewards[3:] == [1.0, 0.0, 1.0, 0.25]
    assert 0.0 < rewards[2] < 1.0
