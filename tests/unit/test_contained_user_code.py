"""Users' tools and environments inside a trajectory, whatever they raise or return
(rollout/user_calls.py, rollout/toolbox.py, rollout/trajectory.py, rollout/environment_reply.py):
SystemExit, KeyboardInterrupt, a CancelledError nobody asked for and an exception whose str()
raises are each that call's error, counted; only groupflow's own cancellation goes through; an
environment's answer of the wrong shape is an environment error naming the field, never a
failed chunk or a driver that dies on the step's figures."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import pytest

from groupflow.core.records import ToolUse
from groupflow.observe.rollout_figures import agent_figures
from groupflow.reward_workers.tasks.tool_arithmetic import CHAT_TEMPLATE, tool_call_text
from groupflow.rollout.calculator_tool import Calculator
from groupflow.rollout.environment_reply import Observation
from groupflow.rollout.observations import ObservationRenderer
from groupflow.rollout.toolbox import ToolBox, ToolCall, ToolCallParser
from groupflow.rollout.trajectory import ToolEnvironment, TurnLimits, run_trajectory
from tests.unit.test_trajectory import TASK, ScriptedEngine, renderer_for, run


class Unprintable(Exception):
    def __str__(self):
        raise SystemExit("not even this")


def _argparse_exit(text: str):
    """A user's code built on argparse: bad arguments exit (SystemExit 2), as in a CLI."""
    parser = argparse.ArgumentParser(prog="sim")
    parser.add_argument("--steps", type=int, required=True)
    parser.parse_args(text.split())


def _cancel_own_task():
    asyncio.current_task().cancel()


async def _sleep_then(action):
    await asyncio.sleep(0)
    action()
    await asyncio.sleep(1)  # reached only by code that cancelled its own task


def _raise(err: BaseException):
    def action(*_):
        raise err

    return action


# what users' code does -> the type named in the error it becomes
RAISES = {
    "sys.exit": (_raise(SystemExit(3)), "SystemExit: 3"),
    "argparse": (_argparse_exit, "SystemExit: 2"),
    "KeyboardInterrupt": (_raise(KeyboardInterrupt()), "KeyboardInterrupt"),
    "CancelledError": (_raise(asyncio.CancelledError()), "CancelledError"),
    "unprintable": (_raise(Unprintable()), "Unprintable: <Unprintable whose str() raised>"),
}


def _environment(action, kind: str):
    """An environment whose step (sync: in a thread; async: on the loop), or whose factory,
    does `action`."""

    class Sync:
        def __init__(self, prompt):
            if kind == "factory":
                action("")

        def step(self, turn):
            action(turn)

    class Async:
        def __init__(self, prompt):
            pass

        async def step(self, turn):
            await asyncio.sleep(0)
            action(turn)

    return Async if kind == "async" else Sync


@pytest.mark.parametrize("kind", ["sync", "async", "factory"])
@pytest.mark.parametrize("what", sorted(RAISES))
def test_whatever_an_environment_raises_ends_its_trajectory_only(what, kind):
    action, named = RAISES[what]
    renderer = renderer_for(CHAT_TEMPLATE)
    _, _, response = run(
        renderer, ScriptedEngine(renderer.tokenizer, ["1"]), _environment(action, kind)
    )
    assert response.end_reason == "environment_error"
    assert response.error == named
    assert response.turns == 1 and response.token_ids


class SelfCancelling:
    def __init__(self, prompt):
        pass

    async def step(self, turn):
        await _sleep_then(_cancel_own_task)


class StepThatExits:
    def __init__(self, prompt):
        pass

    @property
    def step(self):
        raise SystemExit(1)


@pytest.mark.parametrize(
    ("environment", "named"),
    [(SelfCancelling, "CancelledError"), (StepThatExits, "SystemExit: 1")],
)
def test_an_environment_cancelling_its_own_task_or_exiting_on_lookup_is_its_error(
    environment, named
):
    renderer = renderer_for(CHAT_TEMPLATE)
    _, _, response = run(renderer, ScriptedEngine(renderer.tokenizer, ["1"]), environment)
    assert (response.end_reason, response.error) == ("environment_error", named)


def test_an_evaluation_of_exiting_environments_still_gets_every_answer():
    """`groupflow eval` runs an engine's trajectories on a loop of its own
    (run_until_complete of one gather): an environment that exits ends its trajectory, not
    the command (which once exited 0 with no result line)."""
    renderer = renderer_for(CHAT_TEMPLATE)
    box = ToolBox([Calculator()], 5.0, 200)
    observations = ObservationRenderer(renderer)
    parser = ToolCallParser("hermes", renderer.tokenizer, box.schemas)
    prompts = list(TASK.eval_prompts(6))
    exits = _environment(_raise(SystemExit(0)), "async")

    def environment(prompt):
        odd = prompts.index(prompt) % 2
        return exits(prompt) if odd else ToolEnvironment(prompt, box, parser)

    async def answers():
        return await asyncio.gather(
            *(
                run_trajectory(
                    p,
                    renderer.ids(p),
                    ScriptedEngine(renderer.tokenizer, [str(p.answer)]),
                    environment,
                    observations,
                    TurnLimits(4, 96, 240, 5.0),
                    256,
                )
                for p in prompts
            )
        )

    loop = asyncio.new_event_loop()
    try:
        responses = loop.run_until_complete(answers())
    finally:
        loop.close()
    reasons = [r.end_reason for r in responses]
    assert reasons == ["answer", "environment_error"] * 3
    assert agent_figures(responses)["end_reasons"] == {"answer": 3, "environment_error": 3}


class Endless:
    def __init__(self, prompt):
        pass

    async def step(self, turn):
        await asyncio.sleep(60)


class EndlessSync:
    def __init__(self, prompt):
        pass

    def step(self, turn):
        time.sleep(0.5)


@pytest.mark.parametrize("environment", [Endless, EndlessSync])
def test_a_cancellation_groupflow_asks_for_goes_through(environment):
    """The engine stopping a trajectory (its chunk cancelled) cancels it: no error answer."""
    renderer = renderer_for(CHAT_TEMPLATE)
    prompt = next(TASK.train_prompts(seed=1))

    async def cancel_while_stepping():
        task = asyncio.ensure_future(
            run_trajectory(
                prompt,
                renderer.ids(prompt),
                ScriptedEngine(renderer.tokenizer, ["1"]),
                environment,
                ObservationRenderer(renderer),
                TurnLimits(4, 96, 240, 30.0),
                256,
            )
        )
        await asyncio.sleep(0.1)  # the trajectory is in its step
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return task.cancelled()

    assert asyncio.run(cancel_while_stepping())


# --- tools ----------------------------------------------------------------------------------


def _tool(name: str, action, is_async: bool):
    class SyncTool:
        description, parameters = "hostile", {"type": "object"}

        def __call__(self, arguments):
            return action(arguments.get("text", ""))

    class AsyncTool(SyncTool):
        async def __call__(self, arguments):
            await asyncio.sleep(0)
            return action(arguments.get("text", ""))

    tool = (AsyncTool if is_async else SyncTool)()
    tool.name = name
    return tool


@pytest.mark.parametrize("is_async", [False, True])
@pytest.mark.parametrize("what", sorted(RAISES))
def test_whatever_a_tool_raises_is_its_error_the_model_reads(what, is_async):
    action, named = RAISES[what]
    box = ToolBox([_tool("hostile", action, is_async), Calculator()], 1.0, 500)

    async def calls():
        # the same loop goes on serving the next call
        return [
            await box.call(ToolCall(n, {"expression": "6*7"})) for n in ("hostile", "calculator")
        ]

    hostile, calculator = asyncio.run(calls())
    assert (hostile.use.outcome, hostile.content) == ("error", f"error: {named}")
    assert (calculator.use.outcome, calculator.content) == ("ok", "42")


def test_a_tool_cancelling_its_own_task_and_one_whose_result_cannot_be_printed():
    class Cancels:
        name, description, parameters = "cancels", "cancels its own task", {"type": "object"}

        async def __call__(self, arguments):
            await _sleep_then(_cancel_own_task)

    class NoText:
        def __str__(self):
            raise KeyboardInterrupt

    unprintable = _tool("unprintable", lambda _: NoText(), False)
    box = ToolBox([Cancels(), unprintable], 1.0, 500)

    def call(name):
        return asyncio.run(box.call(ToolCall(name, {})))

    assert (call("cancels").use.outcome, call("cancels").content) == (
        "error",
        "error: CancelledError",
    )
    assert "whose str() raised" in call("unprintable").content


def test_a_tool_call_groupflow_cancels_is_cancelled():
    box = ToolBox([_tool("slow", lambda _: time.sleep(0.5), False)], 5.0, 100)

    async def cancel_while_calling():
        task = asyncio.ensure_future(box.call(ToolCall("slow", {})))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return task.cancelled()

    assert asyncio.run(cancel_while_calling())


# --- what an environment answers ------------------------------------------------------------

MESSAGES = [{"role": "tool", "content": "seen"}]


@pytest.mark.parametrize(
    ("answer", "named"),
    [
        ({"role": "tool", "content": "x"}, "step returned dict"),
        ("text", "step returned str"),
        (Observation(MESSAGES, ToolUse("calc", "ok")), "Observation.tool_uses is ToolUse"),
        (
            Observation(MESSAGES, [{"tool": "calc", "outcome": "ok"}]),
            "Observation.tool_uses[0] is dict: expected a ToolUse",
        ),
        (Observation(MESSAGES, [ToolUse(3, "ok")]), "Observation.tool_uses[0].tool is int"),
        (
            Observation(MESSAGES, [ToolUse("calc", "done")]),
            "Observation.tool_uses[0].outcome is 'done'",
        ),
        (
            Observation(MESSAGES, [ToolUse("calc", "ok", "1.5")]),
            "Observation.tool_uses[0].seconds is str",
        ),
        (
            Observation(MESSAGES, [ToolUse("calc", "ok", float("nan"))]),
            "Observation.tool_uses[0].seconds is nan",
        ),
        (
            Observation(MESSAGES, [ToolUse("calc", "ok", True)]),
            "Observation.tool_uses[0].seconds is bool",
        ),
        (Observation({"role": "tool", "content": "x"}), "Observation.messages is dict"),
        (
            Observation([{"role": "tool", "content": 5}]),
            "Observation.messages[0]['content'] is int",
        ),
        ([{"role": "tool", "content": "x"}, "y"], "step's messages[1] is str"),
        ([{"content": "x"}], "step's messages[0]['role'] is NoneType"),
    ],
)
def test_an_answer_of_the_wrong_shape_is_an_environment_error_naming_the_field(answer, named):
    class Answers:
        def __init__(self, prompt):
            pass

        def step(self, turn):
            return answer

    renderer = renderer_for(CHAT_TEMPLATE)
    _, _, response = run(renderer, ScriptedEngine(renderer.tokenizer, ["1"]), Answers)
    assert response.end_reason == "environment_error"
    assert response.error.startswith(named), response.error
    assert "\n" not in response.error
    figures = agent_figures([response])  # what killed the driver after the learner's step
    assert figures["end_reasons"] == {"environment_error": 1} and figures["tool_calls"] == {}


def test_a_good_answer_is_copied_and_counted():
    """What passes is a copy: an environment that changes its answer afterwards (from a thread
    of its own, say) changes nothing of the trajectory's."""
    kept = []

    class Answers:
        def __init__(self, prompt):
            self.turns = 0

        def step(self, turn):
            self.turns += 1
            if self.turns > 1:
                kept[0].tool_uses[0].outcome = "nonsense"
                kept[0].messages[0]["content"] = 7
                return None
            kept.append(
                Observation([{"role": "tool", "content": "84"}], [ToolUse("calc", "ok", 1)])
            )
            return kept[0]

    renderer = renderer_for(CHAT_TEMPLATE)
    _, _, response = run(renderer, ScriptedEngine(renderer.tokenizer, ["1", "2"]), Answers)
    assert (response.end_reason, response.turns) == ("answer", 2)
    assert response.tool_uses == [ToolUse("calc", "ok", 1.0)]
    assert type(response.tool_uses[0].seconds) is float
    assert agent_figures([response])["tool_calls"] == {"calc": 1}


def test_an_answer_whose_reading_raises_is_the_environments_error():
    class Sneaky(list):
        def __iter__(self):
            raise SystemExit("read me not")

    class Answers:
        def __init__(self, prompt):
            pass

        def step(self, turn):
            return Observation(Sneaky([{"role": "tool", "content": "x"}]))

    renderer = renderer_for(CHAT_TEMPLATE)
    _, _, response = run(renderer, ScriptedEngine(renderer.tokenizer, ["1"]), Answers)
    assert response.end_reason == "environment_error"
    assert "SystemExit: read me not" in response.error


def test_the_built_in_environment_passes_its_own_check():
    renderer = renderer_for(CHAT_TEMPLATE)
    prompt = next(TASK.train_prompts(seed=4))
    engine = ScriptedEngine(renderer.tokenizer, [tool_call_text(prompt.uid), str(prompt.answer)])
    _, _, response = run(renderer, engine, prompt=prompt)
    assert (response.end_reason, [u.outcome for u in response.tool_uses]) == ("answer", ["ok"])
    assert sys.version_info >= (3, 11)  # asyncio's Task.cancelling, which the calls rely on
