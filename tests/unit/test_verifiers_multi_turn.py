"""A multi-turn verifiers taskset (docs/environments.md, "verifiers") played by its own program
through a real rollout endpoint (rollout/verifiers_harness.py) on the scripted engine of
test_endpoint.py, with the real openai SDK behind verifiers' client: what trains is the
engine's ids, the task's own rewards score the trace verifiers recorded, the program's
failures are masked, and what groupflow cannot give is refused in one line."""

from __future__ import annotations

import textwrap
import uuid

import pytest

from groupflow.config import ConfigError
from groupflow.core.records import Verdict
from groupflow.loop.infra_failures import failure_reason
from groupflow.reward_workers.tasks import make_task
from groupflow.rollout.verifiers_harness import play_verifiers_task
from groupflow.run.job_config import build_config
from tests.unit.test_endpoint import exact, harness_run

# A taskset whose program asks, then asks "Sure?" and takes the second reply: two model
# calls, each the conversation so far, as a chat loop sends them.
TWO_TURNS = """
import verifiers.v1 as vf
from openai import AsyncOpenAI


class DoubleData(vf.TaskData):
    answer: str


class DoubleTask(vf.Task[DoubleData]):
    @vf.reward(weight=3.0)
    async def correct(self, task, trace) -> float:
        return 1.0 if trace.last_reply.strip() == task.answer else 0.0

    @vf.reward
    async def checked_twice(self, trace) -> float:
        return float(sum(m.role == "assistant" for m in trace.messages) == 2)


class DoublesConfig(vf.TasksetConfig):
    count: int = 20


class DoublesTaskset(vf.Taskset[DoubleTask, DoublesConfig]):
    def load(self):
        for i in range(self.config.count):
            yield DoubleTask(DoubleData(prompt=f"{i}*2=", answer=str(2 * i)), self.config.task)


class AskTwiceConfig(vf.HarnessConfig):
    pass


class AskTwice(vf.Harness[AskTwiceConfig]):
    NEEDS_CONTAINER = False
    EXECUTES_CODE = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data):
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        messages = [{"role": "user", "content": data.prompt}]
        for follow_up in ("Sure?", None):
            reply = await client.chat.completions.create(model=ctx.model, messages=messages)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            if follow_up is not None:
                messages.append({"role": "user", "content": follow_up})
        await client.close()
        return vf.ProgramResult(0, "", "")
"""
EXPORTS = '["DoublesTaskset", "AskTwice"]'


@pytest.fixture
def taskset(tmp_path, monkeypatch):
    """A verifiers taskset package written here, installed on the path; its id."""

    def write(source: str = TWO_TURNS, exports: str = EXPORTS) -> str:
        name = f"doubles_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source) + f"\n__all__ = {exports}\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        return name

    return write


def test_a_multi_turn_taskset_trains_the_engines_ids_and_scores_its_own_trace(taskset):
    name = taskset()
    cfg = build_config({"task": {"name": f"verifiers:{name}", "options": {"count": 10}}})
    assert (
        cfg.agent.harness == "groupflow.rollout.verifiers_harness:play_verifiers_task"
        and cfg.multi_turn
    )
    task = make_task(f"verifiers:{name}", {"count": 10})
    row = next(p for p in task.train_prompts(0) if p.answer["data"]["answer"] != "0")
    gold = row.answer["data"]["answer"]
    for replies, reward in (([gold, gold], 1.0), (["0", "1"], 0.25)):
        response, serve, _ = harness_run(play_verifiers_task, replies, prompt=row)
        assert (response.end_reason, response.infra_failure, response.turns) == ("answer", None, 2)
        # one sequence, each of its two model runs sampled on exactly the ids before it
        assert (
            response.earlier == [] and exact(response, response.prompt_ids, set(serve.calls)) == 2
        )
        # the rewards ran on verifiers' trace of both turns: (3 * correct + 1 * twice) / 4
        verdict = task.verify(row, response.final_turn)
        assert (verdict.reward, verdict.error) == (reward, None), verdict.reason
    assert task.verify(row, gold).error == "error"  # a bare text is no trace: not a 0


def test_a_failing_program_is_an_infrastructure_failure_masked(taskset):
    name = taskset(TWO_TURNS.replace("return vf.ProgramResult(0,", "return vf.ProgramResult(3,"))
    task = make_task(f"verifiers:{name}", {})
    response, _, _ = harness_run(
        play_verifiers_task, ["1", "2"], prompt=next(task.train_prompts(0))
    )
    assert (response.end_reason, response.infra_failure) == ("environment_error", "harness_error")
    assert "verifiers' rollout failed: HarnessError" in response.error
    assert failure_reason(response, Verdict(0.0, "", "environment")) == "harness_error"


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (("NEEDS_CONTAINER = False", "NEEDS_CONTAINER = True"), "its harness ({name}) needs a container"),
        (("EXECUTES_CODE = False", "EXECUTES_CODE = True"), "its harness ({name}) runs the model's commands on the host"),
        (("checked_twice(self, trace)", "checked_twice(self, trace, runtime)"), "its rewards read a runtime"),
        (("class AskTwiceConfig", "class Duo(vf.Env[vf.EnvConfig]):\n    async def run(self, task, agents):\n        await agents.agent.run(task)\n\n\nclass AskTwiceConfig"), "it ships an Env of its own"),
    ],
)  # fmt: skip
def test_what_groupflow_cannot_give_is_refused_in_one_line(taskset, change, why):
    source = TWO_TURNS.replace(*change)
    name = taskset(source, EXPORTS[:-1] + ', "Duo"]' if "Duo" in source else EXPORTS)
    with pytest.raises(ConfigError) as err:
        build_config({"task": {"name": f"verifiers:{name}"}})
    message = str(err.value)
    assert "\n" not in message
    assert f"verifiers:{name} is a multi-turn taskset ({why.format(name=name)})" in message


def test_its_program_drives_the_job_alone(taskset):
    name = taskset()
    with pytest.raises(ConfigError, match=r"^agent.harness: task verifiers:\w+ is played by"):
        build_config({"task": {"name": f"verifiers:{name}"}, "agent": {"harness": "m:f"}})
    mixture = [{"name": "arithmetic"}, {"name": f"verifiers:{name}"}]
    with pytest.raises(ConfigError, match=r"^task\[1\]: verifiers:\w+ is played by its own"):
        build_config({"task": mixture})
