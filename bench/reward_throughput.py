"""Reward scoring throughput, and how long the driver waits on rewards when scoring
overlaps generation.

    .venv/bin/python bench/reward_throughput.py [--responses 256] [--skip-ray]

0. The message of one group to a reward worker and back, in bytes as Ray pickles it: what the
   worker was sent before (the whole SampledGroup: token ids and vLLM's log-probs included) and
   returned (ScoredGroups carrying their groups), and what it is sent now (each response's
   prompt and text) and returns (its verdicts); `--prompt-tokens`, `--response-tokens` set the
   group's shape.
1. One scorer, no Ray: responses per second verified in the calling process (what a reward
   worker did before its verifier calls moved into killable scorer processes) and through
   1, 2 and 4 scorer processes, for the code verifier (each response runs in the sandbox),
   the math verifier (math-verify equivalence) and arithmetic (the cheapest check: the
   per-call overhead of a scorer process).
2. Responses scored per second by a Ray pool of 1, 2 and 4 reward workers.
3. A short quickstart training run: per step, the time generation takes and the time the
   driver then still waits for rewards (scoring runs on chunks as they finish generating).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from itertools import islice
from pathlib import Path

import ray

from groupflow.actors.reward import start_reward_pool
from groupflow.core.records import Response, SampledGroup, ScoredGroup, Verdict
from groupflow.reward_workers.scorer import Scorer, response_items
from groupflow.reward_workers.tasks import make_task
from groupflow.run.driver import run
from groupflow.run.job_config import build_config, small_model_config

GROUP = 8


def response_for(task_name: str, prompt) -> str:
    if task_name == "code":
        entry = prompt.answer["entry_point"]
        return f"```python\ndef {entry}(*args):\n    return args[0] if args else None\n```"
    if task_name == "arithmetic":
        return str(prompt.answer)
    return f"Adding it up, the answer is \\boxed{{{prompt.answer}}}."


def groups_for(task_name: str, responses: int) -> list[SampledGroup]:
    task = make_task(task_name)
    prompts = list(islice(task.train_prompts(0), responses // GROUP))
    return [
        SampledGroup(p, [0], [Response([0], response_for(task_name, p), [0.0])] * GROUP, 0)
        for p in prompts
    ]


def message_bytes(prompt_tokens: int, response_tokens: int) -> dict[str, int]:
    """Bytes of one group's trip to a reward worker and back, the old way and the new: token
    ids from a 150k vocabulary, a log-prob per response token, about 4 characters a token."""
    prompt = next(make_task("arithmetic").train_prompts(0))
    rng = random.Random(0)

    def response(k: int) -> Response:
        ids = [rng.randrange(150_000) for _ in range(response_tokens)]
        logprobs = [-rng.expovariate(2.0) for _ in range(response_tokens)]
        return Response(ids, f"{k}: " + "7" * (4 * response_tokens), logprobs)

    prompt_ids = [rng.randrange(150_000) for _ in range(prompt_tokens)]
    group = SampledGroup(prompt, prompt_ids, [response(k) for k in range(GROUP)], 0)
    verdicts = [Verdict(1.0, f"correct: {prompt.answer}") for _ in range(GROUP)]

    def size(message) -> int:
        return len(ray.cloudpickle.dumps(message))

    return {
        "sent_before": size([group]),
        "sent_after": size(response_items([group])),
        "returned_before": size(([ScoredGroup(group, verdicts)], 0, 0)),
        "returned_after": size((verdicts, 0, 0)),
    }


def in_process_rate(task_name: str, responses: int) -> float:
    task = make_task(task_name)
    items = [(g.prompt, r.text) for g in groups_for(task_name, responses) for r in g.responses]
    start = time.monotonic()
    rewards = [task.verify(prompt, text).reward for prompt, text in items]
    elapsed = time.monotonic() - start
    assert len(rewards) == len(items)
    return len(items) / elapsed


def scorer_rate(task_name: str, processes: int, responses: int) -> float:
    scorer = Scorer(task_name, processes=processes)
    groups = groups_for(task_name, responses)
    start = time.monotonic()
    scored = scorer.score_groups(groups)
    elapsed = time.monotonic() - start
    scorer.close()
    assert sum(len(g.verdicts) for g in scored) == len(groups) * GROUP
    return len(groups) * GROUP / elapsed


def throughput(task_name: str, workers: int, responses: int) -> float:
    cfg = build_config({"task": {"name": task_name}}, [f"reward.num_workers={workers}"])
    pool = start_reward_pool(cfg)
    ray.get([w.__ray_ready__.remote() for w in pool.workers])  # every worker is up
    groups = groups_for(task_name, responses)
    start = time.monotonic()
    for i in range(0, len(groups), 2):
        pool.submit(groups[i : i + 2], chunk_id=0)
    scored = pool.wait_all()[0]
    elapsed = time.monotonic() - start
    assert sum(len(g.verdicts) for g in scored) == len(groups) * GROUP
    for w in pool.workers:
        ray.kill(w)
    return len(groups) * GROUP / elapsed


def reward_wait(steps: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = small_model_config(
            {},
            [
                f"trainer.steps={steps}",
                f"trainer.output_dir={tmp}",
                "task.eval_size=16",
                "metrics.progress=false",
            ],
        )
        run(cfg)
        lines = (Path(tmp) / cfg.trainer.run_name / "metrics.jsonl").read_text().splitlines()
    steady = [json.loads(x) for x in lines][1:]
    return (
        statistics.fmean(r["time_gen_s"] for r in steady),
        statistics.fmean(r["time_reward_s"] for r in steady),
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--responses", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--skip-ray", action="store_true", help="only parts 0 and 1")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--response-tokens", type=int, default=1024)
    args = parser.parse_args()
    sizes = message_bytes(args.prompt_tokens, args.response_tokens)
    print(
        f"one group of {GROUP} ({args.prompt_tokens} prompt tokens, {args.response_tokens} "
        "response tokens each), bytes to a reward worker / back:\n"
        f"  {'before (whole groups)':<32} {sizes['sent_before']:>9,} / {sizes['returned_before']:>9,}\n"
        f"  {'after (prompt, text; verdicts)':<32} {sizes['sent_after']:>9,} / {sizes['returned_after']:>9,}\n",
        flush=True,
    )
    print(f"one scorer: responses per second ({args.responses} responses, groups of {GROUP})")
    print(f"{'verifier':>10} {'in-process':>10} {'1 proc':>8} {'2 procs':>8} {'4 procs':>8}")
    for task_name in ("arithmetic", "math", "code"):
        before = in_process_rate(task_name, args.responses)
        after = [scorer_rate(task_name, n, args.responses) for n in (1, 2, 4)]
        print(
            f"{task_name:>10} {before:10.1f} {after[0]:8.1f} {after[1]:8.1f} {after[2]:8.1f}",
            flush=True,
        )
    if args.skip_ray:
        return
    ray.init(log_to_driver=False, include_dashboard=False, num_cpus=8)
    print(f"\nRay pool: responses scored per second ({args.responses} responses)")
    print(f"{'verifier':>9} {'1 worker':>9} {'2 workers':>10} {'4 workers':>10}")
    for task_name in ("code", "math"):
        rates = [throughput(task_name, n, args.responses) for n in (1, 2, 4)]
        print(f"{task_name:>9} {rates[0]:9.1f} {rates[1]:10.1f} {rates[2]:10.1f}", flush=True)
    gen, wait = reward_wait(args.steps)
    ray.shutdown()
    print(
        f"\nquickstart, mean of steps 2..{args.steps}: generation {gen:.3f}s per step; "
        f"driver waits {wait:.4f}s more for rewards after generation ends"
    )


if __name__ == "__main__":
    main()
