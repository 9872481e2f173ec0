"""Learner memory per rank and step time, the whole model trained vs LoRA adapters, on one
random-init Qwen2 shape (issue 28).

    .venv/bin/python bench/lora_learner.py [--shape 1024x16] [--lora 8,32,128] [--steps 3]
                                           [--groups 8] [--tokens 64]

For the whole model and each LoRA rank (adapters on every linear layer), starts
`learner.num_ranks` = 2 DeepSpeed ZeRO-3 ranks on a local Ray cluster of its own, trains
`--steps` steps of `--groups` groups of 2 random responses of `--tokens` tokens, and prints
the median step time and each rank's resident memory after the last step (the process's RSS:
on this CPU the parameters, gradients and optimizer states all live there), with the shares
of the whole model's. The shape is `bench/weight_sync.py`'s (1024x16: the 605 MB model).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import psutil
import ray
import torch
from weight_sync import random_model

from groupflow.actors.learner import LearnerGroup
from groupflow.core.records import TrainSequence
from groupflow.run.job_config import build_config


def sequences(groups: int, tokens: int, vocab: int, seed: int) -> list[TrainSequence]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for g in range(groups):
        prompt = torch.randint(0, vocab, (16,), generator=gen).tolist()
        for sign in (1.0, -1.0):
            response = torch.randint(0, vocab, (tokens,), generator=gen).tolist()
            out.append(TrainSequence(prompt + response, len(prompt), sign, g, 0, []))
    return out


def rank_rss(learner: LearnerGroup) -> list[int]:
    pids = ray.get([r.__ray_call__.remote(lambda _self: os.getpid()) for r in learner.ranks])
    return [psutil.Process(pid).memory_info().rss for pid in pids]


def measure(model_dir: str, lora: int | None, args, vocab: int) -> tuple[float, list[int]]:
    overrides = ["learner.num_ranks=2", "learner.optimizer.lr=1e-5"]
    if lora is not None:
        overrides += [f"learner.lora.rank={lora}", f"learner.lora.alpha={2 * lora}"]
    learner = LearnerGroup(build_config({}, overrides), model_dir)
    try:
        seconds = []
        for step in range(args.steps + 1):  # the first one warms up
            seqs = sequences(args.groups, args.tokens, vocab, step)
            start = time.perf_counter()
            ray.get(learner.async_train_step(seqs))
            seconds.append(time.perf_counter() - start)
        return statistics.median(seconds[1:]), rank_rss(learner)
    finally:
        learner.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1024x16", help="hidden size x layers")
    parser.add_argument("--lora", default="8,32,128", help="LoRA ranks")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64, help="response tokens")
    args = parser.parse_args()
    hidden, layers = (int(x) for x in args.shape.split("x"))
    ray.init(num_cpus=8, log_to_driver=False, include_dashboard=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            nbytes = random_model(hidden, layers, Path(tmp))
            from transformers import AutoConfig

            vocab = AutoConfig.from_pretrained(tmp).vocab_size
            print(f"shape {args.shape}, {nbytes / 1e6:.0f} MB, 2 ranks", flush=True)
            print("trained        step time   rank memory (RSS)        vs whole model", flush=True)
            whole = None
            for lora in [None, *(int(r) for r in args.lora.split(",") if r)]:
                seconds, rss = measure(tmp, lora, args, vocab)
                label = "whole model" if lora is None else f"lora r={lora}"
                whole = whole or (seconds, sum(rss))
                print(
                    f"{label:12s} {seconds:8.2f} s   "
                    f"{' '.join(f'{r / 2**20:7.0f} MiB' for r in rss)}   "
                    f"time {seconds / whole[0]:5.2f}x  memory {sum(rss) / whole[1]:5.2f}x",
                    flush=True,
                )
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
