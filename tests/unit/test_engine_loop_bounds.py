"""What users' code can do to an engine's event loop (issue 39, cause 3): no size it chooses
reaches the loop unbounded, the built-in tools keep threads of their own, the tool pool's
client cancels the calls it gave up on, and async code that blocks the loop is detected,
counted and warned about (rollout/loop_watch.py). Virtual clocks, no timed asserts."""

from __future__ import annotations

import asyncio
import threading

import pytest

from groupflow.actors import tools as tool_pool
from groupflow.observe.rollout_figures import agent_figures
from groupflow.rollout import observations as observations_module
from groupflow.rollout.calculator_tool import Calculator
from groupflow.rollout.environment_reply import Observation
from groupflow.rollout.loop_watch import LoopWatch
from groupflow.rollout.toolbox import ToolBox, ToolCall
from groupflow.rollout.user_calls import LOOP_WATCH, USER_CALLS
from tests.unit.test_trajectory import ScriptedEngine, renderer_for, run

TEMPLATE = renderer_for  # the tool task's template, in the built-in tokenizer's alphabet


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ----- a size of the environment's choosing -------------------------------------------------
class Huge:
    """An environment answering every turn with a 20 MB message."""

    def __init__(self, prompt):
        pass

    def step(self, turn):
        return Observation([{"role": "tool", "content": "7" * (20 << 20)}])


def test_an_observation_that_cannot_fit_is_never_rendered(monkeypatch):
    """The 20 MB message ended token_limit after 51 s of rendering on the loop: now it ends so
    before anything renders it."""
    from tests.unit.test_trajectory import CHAT_TEMPLATE

    renderer = renderer_for(CHAT_TEMPLATE)
    rendered = []
    original = observations_module.ObservationRenderer.ids

    def spy(self, messages, last):
        rendered.append(sum(len(m["content"]) for m in messages))
        return original(self, messages, last)

    monkeypatch.setattr(observations_module.ObservationRenderer, "ids", spy)
    engine = ScriptedEngine(renderer.tokenizer, ["1", "2"])
    _, _, response = run(renderer, engine, environment=Huge)
    assert response.end_reason == "token_limit" and response.turns == 1
    assert max(rendered) < 1000  # the template's probe only: never the 20 MB


def test_an_observation_that_may_fit_is_rendered_off_the_loop(monkeypatch):
    from tests.unit.test_trajectory import CHAT_TEMPLATE

    renderer = renderer_for(CHAT_TEMPLATE)
    threads = []
    original = observations_module.ObservationRenderer.ids

    def spy(self, messages, last):
        threads.append(threading.current_thread().name)
        return original(self, messages, last)

    class Short:
        def __init__(self, prompt):
            pass

        def step(self, turn):
            return Observation([{"role": "tool", "content": "7"}])

    monkeypatch.setattr(observations_module.ObservationRenderer, "ids", spy)
    engine = ScriptedEngine(renderer.tokenizer, ["1", "2", "3", "4"])
    _, _, response = run(renderer, engine, environment=Short)
    assert response.turns == 4
    assert threads[-1].startswith("observations")  # not the loop's thread


def test_the_bound_is_what_the_room_can_hold_at_most():
    from tests.unit.test_trajectory import CHAT_TEMPLATE

    observations = observations_module.ObservationRenderer(renderer_for(CHAT_TEMPLATE))
    longest = max(map(len, observations.renderer.tokenizer.get_vocab()))
    assert observations.max_chars(10) == 10 * longest and observations.max_chars(-3) == 0


# ----- the built-in tools' threads ---------------------------------------------------------
class Hung:
    """A user's sync tool that hangs until released."""

    name, description, parameters = "hung", "hangs", {"type": "object"}

    def __init__(self):
        self.release = threading.Event()

    def __call__(self, arguments):
        self.release.wait()
        return "late"


def test_hung_user_tools_do_not_starve_the_calculator():
    hung = Hung()
    box = ToolBox([hung, Calculator()], 3600.0, 200, builtin=frozenset({"calculator"}))

    async def scenario():
        held = [asyncio.ensure_future(box.call(ToolCall("hung", {}))) for _ in range(8)]
        await asyncio.sleep(0)
        done, _ = await asyncio.wait(
            [asyncio.ensure_future(box.call(ToolCall("calculator", {"expression": "6*7"})))],
            timeout=60,  # a hang guard, not a timing: without own threads it never finishes
        )
        hung.release.set()
        await asyncio.gather(*held)
        return [t.result().content for t in done]

    assert asyncio.run(scenario()) == ["42"]


def test_the_built_in_environment_is_made_without_a_thread():
    from groupflow.rollout.agent import Agent, AgentSettings

    settings = AgentSettings(["calculator"], None, "hermes", 2, None, 10.0, 5.0, 100)
    assert asyncio.iscoroutinefunction(Agent(settings, None).environment)


def test_a_tool_result_becomes_text_in_the_tools_thread():
    seen = []

    class Big:
        def __str__(self):
            seen.append(threading.current_thread().name)
            return "x" * 10_000

    class Returns:
        name, description, parameters = "obj", "returns an object", {"type": "object"}

        def __call__(self, arguments):
            return Big()

    reply = asyncio.run(ToolBox([Returns()], 5.0, 100).call(ToolCall("obj", {})))
    assert seen[0].startswith("user-code") and reply.content == "x" * 100 + " ...(cut)"


# ----- the tool pool's client --------------------------------------------------------------
def test_the_tool_pool_client_cancels_a_call_its_caller_gave_up_on(monkeypatch):
    cancelled = []
    monkeypatch.setattr(tool_pool.ray, "cancel", lambda ref: cancelled.append(ref))

    class Worker:
        class run:  # noqa: N801 - the shape of an actor's method
            @staticmethod
            def remote(code, timeout_s):
                return asyncio.get_running_loop().create_future()  # never answers

    client = tool_pool.ToolPoolClient([Worker()])

    async def scenario():
        call = asyncio.ensure_future(client.run("print(1)", 5.0))
        await asyncio.sleep(0)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    asyncio.run(scenario())
    assert len(cancelled) == 1 and client.in_flight == [0]


# ----- blocks of the loop ------------------------------------------------------------------
def test_async_code_that_blocks_the_loop_is_counted_and_named():
    clock, warned = FakeClock(), []
    watch = LoopWatch(clock=clock, warn=lambda *a: warned.append(a[0] % a[1:]), watchdog=False)

    async def blocking():
        clock.now += 3.0  # what time.sleep(3) would do to the loop
        await asyncio.sleep(0)
        clock.now += 0.1  # a short run after the await: no block
        return "done"

    async def polite():
        await asyncio.sleep(0)
        return "ok"

    async def scenario():
        return await watch.timed(blocking(), "tool 'slow'"), await watch.timed(polite(), "x")

    assert asyncio.run(scenario()) == ("done", "ok")
    assert watch.blocks == 1 and len(warned) == 1
    assert warned[0].startswith("tool 'slow' held the engine's event loop for 3.0s:")


def test_a_block_that_never_ends_is_seen_while_it_holds_the_loop():
    clock, warned = FakeClock(), []
    watch = LoopWatch(clock=clock, warn=lambda *a: warned.append(a[0] % a[1:]), watchdog=False)

    async def spinning():
        clock.now += 2.0
        watch.check()  # the watchdog thread's look, while the code still runs
        clock.now += 2.0
        return None

    async def scenario():
        return await watch.timed(spinning(), "agent.environment")

    asyncio.run(scenario())
    assert watch.blocks == 1  # seen once, not again when it ends
    assert warned == [
        "agent.environment held the engine's event loop for 2.0s and still holds it: async "
        "users' code must not block (await what it waits on, or make it a sync function, "
        "which runs in a thread)"
    ]


def test_a_trajectorys_blocks_reach_its_step_record(monkeypatch):
    from tests.unit.test_trajectory import CHAT_TEMPLATE

    clock = FakeClock()
    monkeypatch.setattr(LOOP_WATCH, "clock", clock)
    monkeypatch.setattr(LOOP_WATCH, "warn", lambda *a: None)

    class Sleepy:
        def __init__(self, prompt):
            pass

        async def step(self, turn):
            clock.now += 1.0  # blocks, then ends the trajectory
            return None

    renderer = renderer_for(CHAT_TEMPLATE)
    _, _, response = run(renderer, ScriptedEngine(renderer.tokenizer, ["1"]), environment=Sleepy)
    assert response.loop_blocks == 1
    assert agent_figures([response, response])["event_loop_blocks"] == 2
    assert USER_CALLS.watch is LOOP_WATCH
