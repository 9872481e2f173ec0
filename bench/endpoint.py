"""The harness endpoint's cost (rollout/endpoint.py, docs/agents.md "Bring your own agent"), on
one real vLLM engine (rollout/engine.py) in this process, with the real openai SDK as client.

    .venv/bin/python bench/endpoint.py [--calls 200] [--call-tokens 8]
                                       [--trajectories 64] [--turns 4] [--tokens 64]

1. Added latency per call: `--calls` calls one after another, alternating the endpoint (an
   AsyncOpenAI chat completion over HTTP: the request parsed by vLLM's protocol models, the
   messages rendered, the call recorded) and the engine's direct path (`_request` on the
   same ids), each generating `--call-tokens` tokens; median and p99 of each and of the
   difference.
2. Throughput: `--trajectories` trajectories at once, each `--turns` calls of `--tokens` /
   turns tokens with a tool message between them (answered at once), through the endpoint
   (a harness per trajectory, as `agent.harness` runs them) against the built-in trajectory
   loop (rollout/trajectory.py) doing the same turns; generated tokens per second, best of
   `--repeats`, and each as a share of the built-in loop's. The endpoint's trajectories run
   twice: calling through the openai SDK's client, and posting the same JSON with a plain
   httpx client (what the SDK's own work costs, apart).

The model is the tool_arithmetic task's built-in one (every call runs to its length).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from multi_turn import COMPACT_TEMPLATE, SleepyTool  # bench/multi_turn.py, beside this script

from groupflow.core.records import Prompt
from groupflow.reward_workers.tasks import make_task
from groupflow.rollout.endpoint import Endpoint, EndpointLimits
from groupflow.rollout.engine import EngineSettings, RolloutEngine
from groupflow.rollout.harness import run_harness
from groupflow.rollout.observations import ObservationRenderer
from groupflow.rollout.prompt_render import ChatSettings
from groupflow.rollout.toolbox import ToolCallParser
from groupflow.rollout.trajectory import TurnLimits, run_trajectory
from groupflow.run.quickstart import quickstart_model_path


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def latency(engine, endpoint: Endpoint, prompt: Prompt, calls: int, tokens: int):
    from openai import AsyncOpenAI
    from vllm import SamplingParams

    limits = EndpointLimits(calls + 1, tokens, engine.max_model_len)
    session = endpoint.open(limits)
    client = AsyncOpenAI(base_url=endpoint.base_url(session), api_key=endpoint.key, max_retries=0)
    messages = [{"role": "user", "content": prompt.text}]
    ids = engine.renderer.ids(prompt)
    direct, served = [], []
    for _ in range(calls):
        start = time.perf_counter()
        await engine._request(ids, SamplingParams(max_tokens=tokens, ignore_eos=True, logprobs=0))
        direct.append(time.perf_counter() - start)
        start = time.perf_counter()
        await client.chat.completions.create(
            model=endpoint.model,
            messages=messages,
            max_tokens=tokens,
            extra_body={"ignore_eos": True},
        )
        served.append(time.perf_counter() - start)
    await client.close()
    endpoint.close(session)
    return direct, served


async def through_endpoint(
    endpoint: Endpoint, prompts, turns: int, per_turn: int, context: int, sdk: bool = True
):
    """The trajectories' harnesses call through the openai SDK's client (`sdk`), or post the
    same JSON with one plain httpx client: the SDK's own work per call, apart."""
    import httpx

    plain = httpx.AsyncClient(headers={"authorization": f"Bearer {endpoint.key}"}, timeout=3600)

    async def harness(row, given):
        messages = [{"role": "user", "content": row.text}]
        for _ in range(turns):
            body = {"model": given.model, "messages": messages, "max_tokens": per_turn}
            if sdk:
                reply = await given.client.chat.completions.create(
                    **body, extra_body={"ignore_eos": True}
                )
                message = reply.choices[0].message.model_dump(exclude_none=True)
            else:
                answer = await plain.post(
                    f"{given.base_url}/chat/completions", json={**body, "ignore_eos": True}
                )
                message = answer.json()["choices"][0]["message"]
            messages.append(message)
            messages.append({"role": "tool", "content": "ok"})
        return "done"

    limits = EndpointLimits(turns, per_turn, context)
    start = time.perf_counter()
    responses = await asyncio.gather(
        *(run_harness(harness, p, endpoint, limits, 3600.0, 0) for p in prompts)
    )
    seconds = time.perf_counter() - start
    await plain.aclose()
    failed = [
        r.error or r.infra_failure or "split" for r in responses if r.infra_failure or r.earlier
    ]
    assert not failed, failed[:3]
    return sum(sum(r.loss_mask) for r in responses) / seconds


class _NoSleep:
    """The built-in loop's tool answers at once, as the harness's does."""

    @staticmethod
    def uniform(a, b):
        return 0.0


async def built_in(engine, prompts, turns: int, per_turn: int):
    from vllm import SamplingParams

    from groupflow.rollout.engine import _response

    observations = ObservationRenderer(engine.renderer)
    limits = TurnLimits(turns, per_turn, 10_000, 3600.0)

    async def generate(ids, max_tokens, turn):
        params = SamplingParams(n=1, max_tokens=per_turn, ignore_eos=True, logprobs=0)
        out, version = await engine._request(ids, params)
        response = _response(out.outputs[0], version)
        response.finish_reason = "stop"  # a turn of known length, not a cut one
        return response

    def trajectory(prompt):
        ids = engine.renderer.ids(prompt)
        environment = lambda p: SleepyTool(turns - 1, 0.0, _NoSleep())  # noqa: E731
        return run_trajectory(
            prompt, ids, generate, environment, observations, limits, engine.max_model_len
        )

    start = time.perf_counter()
    responses = await asyncio.gather(*(trajectory(p) for p in prompts))
    seconds = time.perf_counter() - start
    return sum(sum(r.loss_mask) for r in responses) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--call-tokens", type=int, default=8)
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    model = quickstart_model_path("tool_arithmetic", {}, 30, progress=False)
    template = Path(tempfile.mkdtemp()) / "compact.jinja"
    template.write_text(COMPACT_TEMPLATE)
    chat = ChatSettings(chat_template=str(template))
    engine = RolloutEngine(EngineSettings(str(model), max_model_len=256, seed=0, chat=chat))
    tool_parser = ToolCallParser("hermes", engine.tokenizer, [])
    prompts = make_task("tool_arithmetic").eval_prompts(args.trajectories)
    per_turn = args.tokens // args.turns

    async def run_all():
        endpoint = Endpoint(engine._serve_call, engine._harness_renderer, tool_parser, "tiny")
        await endpoint.start()
        await latency(engine, endpoint, prompts[0], 4, args.call_tokens)  # first calls
        direct, served = await latency(engine, endpoint, prompts[0], args.calls, args.call_tokens)
        rates = {"endpoint": [], "endpoint, httpx": [], "built-in loop": []}
        for _ in range(args.repeats):
            rates["built-in loop"].append(await built_in(engine, prompts, args.turns, per_turn))
            rates["endpoint"].append(
                await through_endpoint(endpoint, prompts, args.turns, per_turn, 256)
            )
            rates["endpoint, httpx"].append(
                await through_endpoint(endpoint, prompts, args.turns, per_turn, 256, sdk=False)
            )
        await endpoint.stop()
        return direct, served, rates

    direct, served, rates = asyncio.run(run_all())
    added = [s - d for s, d in zip(served, direct, strict=True)]
    print(f"latency per call, {args.calls} calls of {args.call_tokens} tokens (ms):")
    print(f"{'':>16}  {'median':>8}  {'p99':>8}")
    for name, values in (("direct", direct), ("endpoint", served), ("added", added)):
        print(
            f"{name:>16}  {statistics.median(values) * 1000:>8.1f}  "
            f"{percentile(values, 0.99) * 1000:>8.1f}"
        )
    print(
        f"throughput, {args.trajectories} concurrent trajectories x {args.turns} calls of "
        f"{per_turn} tokens (generated tokens/s, best of {args.repeats}):"
    )
    best = {name: max(values) for name, values in rates.items()}
    for name, rate in best.items():
        print(f"{name:>16}  {rate:>8.0f}  {rate / best['built-in loop']:>5.2f}x")


if __name__ == "__main__":
    main()
