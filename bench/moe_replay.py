"""Rollout routing replay (learner.moe.routing_replay, issue 40): log-prob mismatch between an
engine and the learner, and their routing disagreement, with and without replay.

    .venv/bin/python bench/moe_replay.py                     # the small MoE: a few minutes on 2 cores
    .venv/bin/python bench/moe_replay.py --router-noise 0,0.01,0.05 --groups 8

One in-process vLLM engine (rollout/engine.py, routing returned) samples groups from the small
MoE (groupflow/run/small_moe.py, float32); the learner's forward (learner/micro_batch.py, the
token head and the routers' hooks of learner/model_setup.py) scores the same sequences with
the same weights, except that its routers' weights get Gaussian noise of the given scale
relative to their own: a learner one update ahead of the sampler, whose router is near ties
on some tokens. For each scale, without and with replay: the mean and max |engine log-prob -
learner log-prob| over the sampled tokens, and the share of (token, layer) pairs whose top-k
the learner's own router chose otherwise than the engine. At scale 0 both sides hold the same
weights: the mismatch is float noise and the disagreement ties only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--router-noise", default="0,0.01,0.05")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument(
        "--model", default=None, help="a Qwen3-MoE directory (default: the small MoE)"
    )
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from groupflow.config.learner import LearnerConfig, MoeConfig
    from groupflow.config.rollout import SamplingConfig
    from groupflow.core.records import TrainSequence
    from groupflow.learner.micro_batch import response_token_stats
    from groupflow.learner.model_setup import prepare_model
    from groupflow.learner.routing_replay import routing_state
    from groupflow.reward_workers.tasks import make_task
    from groupflow.rollout.engine import EngineSettings, RolloutEngine
    from groupflow.run.small_moe import small_moe_path

    path = args.model or str(small_moe_path(progress=False))
    engine = RolloutEngine(EngineSettings(model_path=path, max_model_len=256, routed_experts=True))
    sampling = SamplingConfig(max_tokens=args.max_tokens, temperature=1.0)
    prompts = [
        p
        for _, p in zip(
            range(args.groups), make_task("arithmetic").train_prompts(seed=0), strict=False
        )
    ]

    async def sample():
        return await asyncio.gather(
            *(engine.sample_group(p, args.group_size, sampling) for p in prompts)
        )

    groups = asyncio.run(sample())
    seqs = [
        TrainSequence(
            g.prompt_ids + r.token_ids,
            len(g.prompt_ids),
            0.0,
            i,
            0,
            r.logprobs,
            routed_experts=r.routed_experts,
        )
        for i, g in enumerate(groups)
        for r in g.responses
    ]
    engine_logp = torch.tensor([x for s in seqs for x in s.vllm_logprobs], dtype=torch.float64)
    print(f"{len(seqs)} sequences, {len(engine_logp)} sampled tokens")
    print("router noise | replay | logp mismatch mean | max | routing disagreement")
    for noise in (float(x) for x in args.router_noise.split(",")):
        for replay in ("off", "rollout"):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            with torch.no_grad():
                for layer in model.model.layers:
                    gate = layer.mlp.gate.weight
                    gate += noise * gate.std() * torch.randn_like(gate)
            prepare_model(model, LearnerConfig(moe=MoeConfig(routing_replay=replay)), False)
            # counting is on for a trained model only: this one is scored, so count by hand
            routing_state(model).counting = True
            with torch.no_grad():
                stats = response_token_stats(model, seqs, 1.0, torch.device("cpu"), False)
            logp = torch.cat([s.logp for s in stats]).double()
            diff = (logp - engine_logp).abs()
            counts = routing_state(model).take_counts()
            print(
                f"{noise:12g} | {replay:7} | {diff.mean().item():18.3g} | "
                f"{diff.max().item():8.3g} | {counts.differing / counts.pairs:.4f}"
            )


if __name__ == "__main__":
    main()
