"""Long sequences over sequence-parallel ranks (learner.sequence_parallel_size, issue 42):
peak memory per rank and step time of one learner forward and backward on one long
sequence, at SP 1, 2 and 4.

    .venv/bin/python bench/long_context.py                      # 8k tokens: a few minutes on 2 cores
    .venv/bin/python bench/long_context.py --tokens 8192,16384,32768,65536 --hidden 256

Each size runs as that many gloo ranks in spawned processes (one group, as
learner/sequence_parallel.py forms them), on a small random Qwen2 model in float32 with the
learner's own pieces: the token head, layer checkpointing, the sharded forward
(learner/micro_batch.py's response_token_stats) and Ulysses attention. A step is the forward
of one sequence (a 64-token prompt, the rest response) and the backward of the sum of its
response log-probs. Memory: each rank's resident-set high-water mark during the step above
its resident size just before it (the model, the optimizer-free weights and the imports are
below that line); `ratio` is the mean rank's figure over SP 1's at the same length, which
Ulysses brings towards 1/SP for the activations (the weights and the head's chunk are
per rank whatever the size). On a machine with fewer cores than ranks the times say little:
the ranks share the cores.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import socket
import time

PROMPT = 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rank(rank: int, size: int, port: int, tokens: int, shape: dict, threads: int) -> dict:
    import torch
    import torch.distributed as dist

    from groupflow.config.learner import LearnerConfig
    from groupflow.core.random_model import random_causal_lm
    from groupflow.core.records import TrainSequence
    from groupflow.learner.micro_batch import response_token_stats
    from groupflow.learner.model_setup import prepare_model
    from groupflow.learner.sequence_parallel import install_ulysses, parallel_groups

    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    try:
        layers = {k: v for k, v in shape.items() if k != "vocab_size"}
        model = random_causal_lm(
            shape["vocab_size"], seed=0, max_position_embeddings=tokens, **layers
        ).train()
        prepare_model(model, LearnerConfig(gradient_checkpointing=True))
        sp = parallel_groups(size, rank, size).sequence
        if sp is not None:
            install_ulysses(model, sp)
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, shape["vocab_size"], (tokens,), generator=gen).tolist()
        seq = TrainSequence(ids, PROMPT, 1.0, 0, 0, [])
        dist.barrier()
        before = _rss_bytes()
        started = time.perf_counter()
        (stats,) = response_token_stats(model, [seq], 1.0, torch.device("cpu"), False, True, sp)
        stats.logp.sum().backward()
        dist.barrier()
        step_s = time.perf_counter() - started
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"peak_mib": max(0, peak - before) / 2**20, "step_s": step_s}
    finally:
        dist.destroy_process_group()


def measure(size: int, tokens: int, shape: dict, threads: int) -> list[dict]:
    port = _free_port()
    with multiprocessing.get_context("spawn").Pool(size) as pool:
        return pool.starmap(_rank, [(r, size, port, tokens, shape, threads) for r in range(size)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="8192", help="sequence lengths, comma-separated")
    parser.add_argument("--sizes", default="1,2,4", help="sequence-parallel sizes")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args()
    shape = dict(
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
    )
    print(f"model: {shape}, float32, layer checkpointing, one sequence ({PROMPT}-token prompt)")
    print(f"{'tokens':>7} {'SP':>3} {'peak MiB/rank (max)':>20} {'ratio':>6} {'step s':>7}")
    for tokens in [int(t) for t in args.tokens.split(",")]:
        base = None
        for size in [int(s) for s in args.sizes.split(",")]:
            ranks = measure(size, tokens, shape, args.threads)
            mean = sum(r["peak_mib"] for r in ranks) / size
            worst = max(r["peak_mib"] for r in ranks)
            base = mean if size == 1 else base
            ratio = f"{mean / base:.2f}" if base else "-"
            step = max(r["step_s"] for r in ranks)
            print(f"{tokens:>7} {size:>3} {mean:>11.0f} ({worst:>5.0f}) {ratio:>6} {step:>7.1f}")


if __name__ == "__main__":
    main()
