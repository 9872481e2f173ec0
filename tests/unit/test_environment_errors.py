"""Environments that fail and tool calls that time out (groupflow/observe/environment_errors.py):
the warnings while a job runs, on the step records rollout_figures makes of real responses, and
what `groupflow eval` says of answers that ended environment_error."""

from __future__ import annotations

import logging

import pytest

from groupflow.config.agent import AgentConfig
from groupflow.core.errors import RunError
from groupflow.core.records import Prompt, Response, SampledGroup, ToolUse
from groupflow.observe.environment_errors import TroubleWatch, environment_verdict
from groupflow.observe.rollout_figures import agent_figures


def trajectory(end_reason="answer", error=None, timeouts=0, calls=1) -> Response:
    uses = [ToolUse("python", "timeout" if i < timeouts else "ok") for i in range(calls)]
    return Response(
        [1, 2], "x", [0.0], loss_mask=[1, 1], end_reason=end_reason, tool_uses=uses, error=error
    )


def step_record(step: int, responses: list[Response]) -> dict:
    return {"step": step, **agent_figures(responses)}


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_healthy_step_says_nothing(caplog):
    watch = TroubleWatch("agent.environment")
    with caplog.at_level(logging.WARNING):
        for step in range(1, 5):
            watch.write(step_record(step, [trajectory() for _ in range(4)]))
        watch.write({"step": 5, "reward_mean": 0.0})  # a single-turn job's record
    assert warnings(caplog) == []


def test_environment_errors_warn_at_the_first_step_then_at_each_doubling(caplog):
    watch = TroubleWatch("agent.environment")
    failed = [trajectory("environment_error", "RuntimeError: db down") for _ in range(3)]
    with caplog.at_level(logging.WARNING):
        for step in range(1, 10):
            watch.write(step_record(step, [*failed, trajectory()]))
    said = warnings(caplog)
    assert [line.split(":")[0] for line in said] == ["step 1", "step 2", "step 4", "step 8"]
    assert said[0].startswith("step 1: 3 of 4 trajectories ended environment_error")
    assert "(masked: not trained on)" in said[0]
    assert "check agent.environment" in said[0] and "in 1 steps so far" in said[0]
    assert "in 8 steps so far" in said[-1]


@pytest.mark.parametrize(
    "agent, setting",
    [
        ({}, "agent.environment"),
        ({"environment": "plugins:Env"}, "agent.environment"),
        ({"harness": "plugins:agent"}, "agent.harness"),
    ],
)
def test_the_warnings_name_the_setting_whose_code_runs_the_trajectories(caplog, agent, setting):
    """A harness's failures end environment_error too: the warnings send its user to
    agent.harness, not to an environment the job does not have."""
    named = AgentConfig(**agent).trajectory_setting
    assert named == setting
    watch = TroubleWatch(named)
    with caplog.at_level(logging.WARNING):
        watch.write(step_record(1, [trajectory("environment_error", "boom"), trajectory()]))
        environment_verdict(groups("environment_error", "answer", "answer"), named)
    said = warnings(caplog)
    assert len(said) == 2 and all(
        f"check {setting} " in line or line.endswith(f"check {setting}") for line in said
    )
    other = ({"agent.environment", "agent.harness"} - {setting}).pop()
    assert not any(other in line for line in said)
    with pytest.raises(RunError, match=f"fix {setting}$"):
        environment_verdict(groups("environment_error", "environment_error", "answer"), named)


def test_tool_timeouts_warn_per_tool_naming_the_limit(caplog):
    watch = TroubleWatch("agent.environment")
    with caplog.at_level(logging.WARNING):
        watch.write(step_record(1, [trajectory(timeouts=2, calls=3), trajectory(calls=1)]))
    (line,) = warnings(caplog)
    assert line.startswith(
        "step 1: 2 of 4 calls of tool 'python' timed out at agent.tool_timeout_s"
    )


def groups(*end_reasons: str) -> list[SampledGroup]:
    responses = [
        trajectory(reason, "ValueError: no such table\nTraceback ..." if reason else None)
        for reason in end_reasons
    ]
    return [SampledGroup(Prompt("u", "", None), [1], responses, 0)]


def test_eval_refuses_scores_when_most_answers_ended_environment_error():
    with pytest.raises(RunError) as err:
        environment_verdict(
            groups("environment_error", "environment_error", "answer"), "agent.environment"
        )
    message = str(err.value)
    assert message.startswith("2 of 3 held-out answers ended environment_error (first: ")
    assert "ValueError: no such table Traceback ..." in message and "agent.environment" in message
    assert "\n" not in message


def test_eval_counts_and_warns_of_a_few_environment_errors(caplog):
    with caplog.at_level(logging.WARNING):
        verdict = environment_verdict(
            groups("environment_error", "answer", "token_limit"), "agent.environment"
        )
    assert verdict == {"environment_errors": 1}
    (line,) = warnings(caplog)
    assert line.startswith("1 of 3 held-out answers ended environment_error")


def test_eval_of_single_completions_or_healthy_trajectories_adds_nothing():
    assert environment_verdict(groups("answer", "turn_limit"), "agent.environment") == {}
    single = [SampledGroup(Prompt("u", "", None), [1], [Response([1], "4", [0.0])], 0)]
    assert environment_verdict(single, "agent.environment") == {}
