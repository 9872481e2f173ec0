"""The harness endpoint (rollout/endpoint.py, rollout/harness.py, rollout/harness_record.py)
over real HTTP with the real openai SDK, on a scripted engine: what a harness trains on is
exactly what the engine was given and sampled, history rewritten splits it, and hostile
harnesses are contained, counted and masked. The real engine's side is
tests/integration/test_agent.py."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import httpx
import pytest

from groupflow.core.records import Prompt, Response, ScoredGroup, Verdict
from groupflow.loop.infra_failures import failure_reason
from groupflow.loop.sequences import train_sequences
from groupflow.observe.rollout_figures import agent_figures
from groupflow.reward_workers.tasks.tool_arithmetic import ToolArithmeticTask, tool_call_text
from groupflow.rollout.endpoint import Endpoint, EndpointLimits
from groupflow.rollout.harness import run_harness
from groupflow.rollout.harness_record import HarnessRecord
from groupflow.rollout.prompt_render import ChatSettings, PromptRenderer
from groupflow.rollout.toolbox import ToolCallParser
from groupflow.run.job_config import build_config
from groupflow.run.quickstart import build_tokenizer

TASK = ToolArithmeticTask()
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "exact arithmetic",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
LIMITS = EndpointLimits(max_calls=4, turn_tokens=64, max_model_len=512)
# Concurrent calls of one trajectory, 50 times what it may make: every one past its calls is
# refused as the first ones are (each costs the suite ~40 ms: 1000 took 39 s)
FLOOD = 200


class ScriptedServe:
    """The engine's side of a call: a scripted turn per call (or the same reply), tokenised
    as the engine samples it, ending with the end-of-text token; every call kept."""

    def __init__(self, tokenizer, turns):
        self.tokenizer, self.turns = tokenizer, turns
        self.calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    async def __call__(self, ids, params) -> list[Response]:
        text = self.turns[min(len(self.calls), len(self.turns) - 1)]
        out = self.tokenizer.encode(text)[: params.max_tokens - 1] + [self.tokenizer.eos_token_id]
        self.calls.append((tuple(ids), tuple(out)))
        logprobs = [-random.random() for _ in out]
        return [Response(out, text, logprobs, "stop", [(3, 0)])]


def endpoint_for(turns):
    tokenizer = build_tokenizer(TASK.EXTRA_CHARACTERS, TASK.CHAT_TEMPLATE)
    parser = ToolCallParser("hermes", tokenizer, TOOLS)

    def renderer_for(tools):
        return PromptRenderer(tokenizer, ChatSettings("auto", None, tools))

    serve = ScriptedServe(tokenizer, turns)
    return Endpoint(serve, renderer_for, parser, "tiny"), serve


def harness_run(harness, turns, prompt=None, deadline_s=30.0, limits=LIMITS):
    endpoint, serve = endpoint_for(turns)
    prompt = prompt or Prompt("p0", "12*7=", "84")

    async def main():
        await endpoint.start()
        try:
            return await run_harness(harness, prompt, endpoint, limits, deadline_s, 3)
        finally:
            await endpoint.stop()

    return asyncio.run(main()), serve, endpoint


async def tool_conversation(row, endpoint, rewrite=None, turns=3):
    """Three calls: each reply's tool call answered by a tool message (a reply without one by
    a user message), the reply sent back as the SDK returned it, or rewritten."""
    messages = [{"role": "user", "content": row.text}]
    reply = None
    for _ in range(turns):
        answer = await endpoint.client.chat.completions.create(
            model=endpoint.model, messages=messages, tools=TOOLS
        )
        reply = answer.choices[0].message
        sent = reply.model_dump(exclude_none=True)
        messages.append(sent if rewrite is None else rewrite(sent))
        if reply.tool_calls:
            messages.append(
                {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "84"}
            )
        else:
            messages.append({"role": "user", "content": "1+1="})
    return reply.content or ""


def exact(response: Response, prompt_ids: list[int], calls) -> int:
    """Each run of model tokens was sampled on exactly the ids before it; the runs found."""
    mask, ids = response.loss_mask, response.token_ids
    found = 0
    for start in range(len(mask)):
        if mask[start] and (start == 0 or not mask[start - 1]):
            end = start
            while end < len(mask) and mask[end]:
                end += 1
            assert (tuple(prompt_ids + ids[:start]), tuple(ids[start:end])) in calls
            found += 1
    return found


def test_a_three_call_tool_conversation_is_one_exact_sequence():
    turns = [tool_call_text("12*7"), tool_call_text("84+0"), "84"]
    response, serve, _ = harness_run(tool_conversation, turns)
    assert (response.end_reason, response.infra_failure, response.turns) == ("answer", None, 3)
    assert response.final_turn == "84" and response.earlier == []
    calls = set(serve.calls)
    assert exact(response, response.prompt_ids, calls) == 3
    # every call's prompt extends the last: the engine was given the trained ids so far
    given = [list(ids) for ids, _ in serve.calls]
    trained = response.prompt_ids + response.token_ids
    assert all(trained[: len(g)] == g for g in given)
    assert len(response.logprobs) == sum(response.loss_mask) and response.versions == [(3, 0)]
    # and it trains as one sequence, on the harness's own prompt
    sequence, other = train_sequences(*scored([response]), build_config({}).algorithm)
    assert other.input_ids == [9, 9, 4]  # the group's prompt, for a response without its own
    assert sequence.input_ids == trained and sequence.prompt_len == len(response.prompt_ids)


def test_history_rewritten_splits_into_exact_sequences_sharing_the_reward():
    def forget(message):  # the harness drops the reply's text (its reasoning)
        return {**message, "content": ""}

    async def forgetful(row, endpoint):
        return await tool_conversation(row, endpoint, rewrite=forget)

    turns = ["<think>long</think>" + tool_call_text("12*7"), "<think>x</think>84", "84"]
    response, serve, _ = harness_run(forgetful, turns)
    parts = [*response.earlier, response]
    assert len(parts) == 3 and response.turns == 3
    assert agent_figures([response])["trajectory_splits"] == 2  # counted in the step record
    calls = set(serve.calls)
    assert sum(exact(p, p.prompt_ids, calls) for p in parts) == 3
    groups, advantages = scored([response])
    sequences = train_sequences(groups, advantages, build_config({}).algorithm)
    assert len(sequences) == 4 and len({s.advantage for s in sequences[:3]}) == 1
    for s, p in zip(sequences, parts, strict=False):
        assert s.input_ids == p.prompt_ids + p.token_ids


def test_an_extended_call_after_a_branch_keeps_each_sequence_exact():
    record = HarnessRecord()
    first = Response([5, 6], "a", [-0.1, -0.2], versions=[(0, 0)])
    record.add_call([1, 2], None, [first])
    assert record.ids_continuation([1, 2, 5, 6, 9]).length == 4
    record.add_call([1, 2, 5, 6, 9], record.ids_continuation([1, 2, 5, 6, 9]), [first])
    assert len(record.segments) == 1 and record.segments[0].mask == [1, 1, 0, 1, 1]
    record.add_call([1, 7], record.ids_continuation([1, 7]), [first])  # rewritten
    assert len(record.segments) == 2 and record.segments[1].prompt_ids == [1, 7]


def scored(responses):
    """The responses in a scored group beside one other member, and their advantages."""
    from groupflow.core.records import SampledGroup

    other = Response([4], "4", [-1.0], versions=[(3, 0)])
    group = SampledGroup(Prompt("p0", "12*7=", "84"), [9, 9], [*responses, other], 3)
    verdicts = [Verdict(1.0, "ok")] * len(responses) + [Verdict(0.0, "no")]
    return [ScoredGroup(group, verdicts)], [[0.5] * len(responses) + [-0.5]]


@pytest.mark.parametrize("hostile", ["raises", "returns_no_text", "makes_no_call"])
def test_a_failing_harness_is_masked_as_the_infrastructures(hostile):
    async def harness(row, endpoint):
        if hostile == "makes_no_call":
            return "84"
        await endpoint.client.completions.create(model=endpoint.model, prompt="1+1=")
        if hostile == "raises":
            raise RuntimeError("db down")
        return 84

    response, _, _ = harness_run(harness, ["2"])
    assert response.end_reason == "environment_error"
    assert response.infra_failure == "harness_error"
    assert failure_reason(response, Verdict(0.0, "", "environment")) == "harness_error"
    assert {"raises": "RuntimeError: db down", "returns_no_text": "int"}.get(hostile, "no model")[
        :5
    ] in response.error or hostile == "returns_no_text"


def test_a_harness_past_its_deadline_is_cancelled_and_its_session_closed():
    state = {}

    async def hangs(row, endpoint):
        await endpoint.client.completions.create(model=endpoint.model, prompt="1+1=")
        state["base_url"], state["key"] = endpoint.base_url, endpoint.api_key
        await asyncio.sleep(3600)

    endpoint, serve = endpoint_for(["2"])

    async def main():
        await endpoint.start()
        try:
            response = await run_harness(hangs, Prompt("p", "1+1=", "2"), endpoint, LIMITS, 1.0, 0)
            async with httpx.AsyncClient() as http:  # the session is gone with it
                late = await http.get(
                    state["base_url"] + "/models",
                    headers={"Authorization": f"Bearer {state['key']}"},
                )
            return response, late.status_code
        finally:
            await endpoint.stop()

    response, late = asyncio.run(main())
    assert (response.end_reason, response.infra_failure) == ("deadline", "harness_deadline")
    assert late == 404 and endpoint.refused["unknown"] == 1
    assert len(serve.calls) == 1


def test_another_trajectorys_id_a_flood_and_malformed_messages_never_reach_the_engine():
    import openai

    endpoint, serve = endpoint_for(["2"])
    outcomes = {}

    async def main():
        await endpoint.start()
        try:
            other = endpoint.open(LIMITS)  # another trajectory, open meanwhile

            async def hostile(row, given):
                stolen = given.base_url.replace(
                    given.base_url.split("/")[-2], other.id
                )  # its own key, another's id: the key opens no trajectory by itself
                wrong = openai.AsyncOpenAI(base_url=stolen, api_key="guess", max_retries=0)
                try:
                    await wrong.models.list()
                except openai.AuthenticationError:
                    outcomes["other_id_wrong_key"] = 401
                guessed = given.base_url.replace(given.base_url.split("/")[-2], "guess")
                client = openai.AsyncOpenAI(base_url=guessed, api_key=given.api_key, max_retries=0)
                try:
                    await client.models.list()
                except openai.NotFoundError:
                    outcomes["guessed_id"] = 404
                await client.close()
                await wrong.close()
                try:
                    await given.client.chat.completions.create(
                        model="m", messages=[{"role": "user"}, {"content": 3}]
                    )
                except openai.BadRequestError as err:
                    outcomes["malformed"] = err.status_code
                # the flood as raw HTTP, the cheapest a harness can send it
                body = {"model": "m", "prompt": "1+1="}
                headers = {"Authorization": f"Bearer {given.api_key}"}
                limits = httpx.Limits(max_connections=FLOOD)
                async with httpx.AsyncClient(limits=limits, timeout=300) as http:
                    floods = await asyncio.gather(
                        *(
                            http.post(f"{given.base_url}/completions", json=body, headers=headers)
                            for _ in range(FLOOD)
                        ),
                        return_exceptions=True,
                    )
                outcomes["flood"] = Counter(getattr(f, "status_code", repr(f)) for f in floods)
                return "2"

            response = await run_harness(
                hostile, Prompt("p", "1+1=", "2"), endpoint, LIMITS, 600, 0
            )
            return response, other
        finally:
            await endpoint.stop()

    response, other = asyncio.run(main())
    assert outcomes == {
        "other_id_wrong_key": 401,
        "guessed_id": 404,
        "malformed": 400,
        "flood": {429: FLOOD - LIMITS.max_calls, 200: LIMITS.max_calls},
    }
    assert len(serve.calls) == LIMITS.max_calls  # the flood's first calls only
    assert other.record.calls == 0  # the other trajectory saw none of it
    assert endpoint.refused == {
        "unauthorized": 1,
        "unknown": 1,
        "malformed": 1,
        "over_calls": FLOOD - LIMITS.max_calls,
    }
    # what it sampled, it trains on: the flood's calls, each from the same prompt, are
    # sequences of their own (branches), each exact
    parts = [*response.earlier, response]
    assert len(parts) == LIMITS.max_calls and response.infra_failure is None
    assert all(exact(p, p.prompt_ids, set(serve.calls)) == 1 for p in parts)


def test_a_harness_makes_a_job_multi_turn_and_excludes_an_environment():
    from groupflow.config.base import ConfigError

    assert build_config({"agent": {"harness": "my_agent.py:harness"}}).multi_turn
    both = {"agent": {"harness": "my_agent.py:harness", "environment": "env.py:Env"}}
    with pytest.raises(ConfigError, match="agent.harness: a harness drives its own"):
        build_config(both)
