"""Multi-turn trajectories against single-turn ones at the same number of generated tokens, on
one real vLLM engine (rollout/engine.py) driven by the real trajectory loop
(rollout/trajectory.py), with a tool that sleeps a random 0-200 ms.

    .venv/bin/python bench/multi_turn.py [--trajectories 64] [--tokens 96] [--turns 1 2 4 8]
                                         [--tool-ms 200] [--repeats 2]

Each trajectory generates `--tokens` tokens in all: one turn of that many, or k turns of
tokens / k, with a tool call between turns that sleeps uniformly in [0, tool-ms] ms and
returns a short observation (`=ok`, 3 tokens of a compact template, so that 8 turns fit the
built-in model's 256 positions). All trajectories start at once. Prints per setting:
trajectories per second, generated tokens per second, turns and observation tokens per
trajectory, the engine's idle share (the time no request was in the engine, sampled every 2
ms) and the time relative to single-turn. The model is the tool_arithmetic task's built-in one
(its weights do not matter: every turn runs to its length).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

from groupflow.core.records import Prompt
from groupflow.reward_workers.tasks import make_task
from groupflow.rollout.engine import EngineSettings, RolloutEngine, _response
from groupflow.rollout.observations import ObservationRenderer
from groupflow.rollout.prompt_render import ChatSettings
from groupflow.rollout.trajectory import TurnLimits, run_trajectory
from groupflow.run.quickstart import quickstart_model_path

# The user turn as it is, an assistant turn closed by the end-of-text token, a tool result
# after "=".
COMPACT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}{{ m.content }}{{ eos_token }}"
    "{%- elif m.role == 'tool' -%}={{ m.content }}"
    "{%- else -%}{{ m.content }}{%- endif -%}"
    "{%- endfor -%}"
)


class SleepyTool:
    """Answers each of the first `calls` turns after a random sleep; then ends."""

    def __init__(self, calls: int, tool_s: float, rng: random.Random):
        self.calls, self.tool_s, self.rng = calls, tool_s, rng

    async def step(self, turn: str):
        if self.calls == 0:
            return None
        self.calls -= 1
        await asyncio.sleep(self.rng.uniform(0, self.tool_s))
        return [{"role": "tool", "content": "ok"}]


async def measure(engine, prompts: list[Prompt], turns: int, tokens: int, tool_s: float):
    from vllm import SamplingParams

    per_turn = tokens // turns
    observations = ObservationRenderer(engine.renderer)
    limits = TurnLimits(turns, per_turn, 10_000, 3600.0)
    rng = random.Random(0)

    async def generate(ids, max_tokens, turn):
        params = SamplingParams(n=1, max_tokens=per_turn, ignore_eos=True, temperature=1.0)
        out, version = await engine._request(ids, params)
        response = _response(out.outputs[0], version)
        response.finish_reason = "stop"  # a turn of known length, not a cut one
        return response

    def trajectory(prompt):
        ids = engine.renderer.ids(prompt)
        environment = lambda p: SleepyTool(turns - 1, tool_s, rng)  # noqa: E731
        return run_trajectory(
            prompt, ids, generate, environment, observations, limits, engine.max_model_len
        )

    idle, samples, done = 0, 0, False

    async def watch():
        nonlocal idle, samples
        while not done:
            samples += 1
            idle += not engine._open
            await asyncio.sleep(0.002)

    watcher = asyncio.create_task(watch())
    start = time.perf_counter()
    responses = await asyncio.gather(*(trajectory(p) for p in prompts))
    seconds = time.perf_counter() - start
    done = True
    await watcher
    model = sum(sum(r.loss_mask) for r in responses)
    observed = sum(len(r.loss_mask) - sum(r.loss_mask) for r in responses)
    return dict(
        seconds=seconds,
        model_tokens=model,
        observation_tokens=observed / len(responses),
        idle=idle / max(samples, 1),
        turns=statistics.fmean(r.turns for r in responses),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--turns", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--tool-ms", type=float, default=200.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--prefix-caching",
        action="store_true",
        help="vLLM's prefix caching on: a turn's request computes only what is new",
    )
    args = parser.parse_args()

    model = quickstart_model_path("tool_arithmetic", {}, 30, progress=False)
    template = Path(tempfile.mkdtemp()) / "compact.jinja"
    template.write_text(COMPACT_TEMPLATE)
    chat = ChatSettings(chat_template=str(template))
    settings = EngineSettings(str(model), max_model_len=256, seed=0, chat=chat)
    settings.enable_prefix_caching = True if args.prefix_caching else None
    engine = RolloutEngine(settings)
    prompts = make_task("tool_arithmetic").eval_prompts(args.trajectories)

    async def run_all():
        await measure(engine, prompts[:4], 2, args.tokens, 0.0)  # the engine's first calls
        results = {}
        for turns in args.turns:
            runs = [
                await measure(engine, prompts, turns, args.tokens, args.tool_ms / 1000)
                for _ in range(args.repeats)
            ]
            results[turns] = min(runs, key=lambda r: r["seconds"])
        return results

    results = asyncio.run(run_all())
    base = results[min(results)]["seconds"]
    print(
        f"{args.trajectories} trajectories x {args.tokens} generated tokens, tool sleeps "
        f"U(0, {args.tool_ms:g}) ms between turns; best of {args.repeats}; prefix caching "
        f"{'on' if args.prefix_caching else 'vLLM default'}"
    )
    print(
        f"{'turns':>5}  {'traj/s':>7}  {'gen tok/s':>9}  {'turns/traj':>10}  "
        f"{'obs tok/traj':>12}  {'engine idle':>11}  {'time vs 1 turn':>14}"
    )
    for turns, r in results.items():
        print(
            f"{turns:>5}  {len(prompts) / r['seconds']:>7.1f}  "
            f"{r['model_tokens'] / r['seconds']:>9.0f}  {r['turns']:>10.2f}  "
            f"{r['observation_tokens']:>12.1f}  {r['idle']:>10.1%}  {r['seconds'] / base:>13.2f}x"
        )


if __name__ == "__main__":
    main()
