"""What a CPU rank's allocator setting costs: forward and backward time and peak resident memory
of bench/vs_trl.py's 27M Qwen2 (gradient checkpointing, float32, one thread), with glibc's heap
as it comes ("heap") and with every block of 128 KiB or more mapped apart ("mapped",
learner/host_memory.py map_large_blocks, what a CPU learner rank does), optionally with
transparent huge pages for malloc (GLIBC_TUNABLES=glibc.malloc.hugetlb=1, "thp").

    .venv/bin/python bench/cpu_allocator.py [--rounds 3] [--sequences 8]

Each setting runs in a process of its own (glibc reads its tunables at start), the settings
alternating round by round so that a busy machine weighs on each alike; each run prints its
iterations' times (the first pays warm-up) and its peak resident memory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

SETTINGS = {"heap": {}, "mapped": {}, "mapped+thp": {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}}


def one_run(setting: str, sequences: int, iterations: int) -> None:
    import torch
    from vs_trl import RANDOM27M

    from groupflow.core.random_model import random_causal_lm
    from groupflow.learner.host_memory import map_large_blocks, peak_resident_bytes

    torch.set_num_threads(1)
    if setting != "heap":
        map_large_blocks()
    model = random_causal_lm(80, seed=0, eos_token_id=1, pad_token_id=0, **RANDOM27M).train()
    model.gradient_checkpointing_enable()
    ids = torch.randint(3, 80, (sequences, 6 + 256))
    times = []
    for _ in range(iterations):
        started = time.perf_counter()
        model(input_ids=ids).logits.log_softmax(-1).mean().backward()
        times.append(time.perf_counter() - started)
    print(f"{statistics.median(times[1:]):.2f} {peak_resident_bytes() / 1e9:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: one setting's run
    args = parser.parse_args()
    if args.one:
        one_run(args.one, args.sequences, args.iterations)
        return
    results: dict[str, list[tuple[float, float]]] = {s: [] for s in SETTINGS}
    for _ in range(args.rounds):
        for setting, env in SETTINGS.items():
            command = [sys.executable, __file__, "--one", setting]
            command += ["--sequences", str(args.sequences), "--iterations", str(args.iterations)]
            out = subprocess.run(
                command, env={**os.environ, **env}, capture_output=True, text=True, check=True
            )
            seconds, peak = map(float, out.stdout.split()[-2:])
            results[setting].append((seconds, peak))
            print(f"{setting:>11}: {seconds:6.2f} s a forward+backward, peak {peak:.2f} GB")
    heap = statistics.median(s for s, _ in results["heap"])
    print(f"\nmedian over {args.rounds} rounds, {args.sequences} sequences of 6 + 256 tokens")
    for setting, runs in results.items():
        seconds = statistics.median(s for s, _ in runs)
        peak = statistics.median(p for _, p in runs)
        print(f"{setting:>11}: {seconds:6.2f} s ({seconds / heap:.2f}x heap), peak {peak:.2f} GB")


if __name__ == "__main__":
    main()
