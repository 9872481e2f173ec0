"""How many threads an actor's process runs, from its own Ray resources rather than the node's
core count: on a CPU node the engines, the learner ranks and the reward workers share the
cores, and pools that each start a thread per core slow each other down whenever they overlap
(trainer.max_staleness > 0 overlaps generation and learning by design)."""

from __future__ import annotations

import math

# The thread pools a process of ours may start, each read from the environment when it starts:
# OpenMP's (torch's intra-op threads, DeepSpeed's CPU ops), MKL's and OpenBLAS's (linear
# algebra outside torch's own kernels), and the Rust pool of Hugging Face's fast tokenizers.
_POOLS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS")


def actor_threads(num_cpus: float, cpu_cores: list[int], torch_threads: int | None) -> int:
    """The threads of an actor: `torch_threads` where set; else the cores it is pinned to;
    else its whole CPUs (Ray's num_cpus, rounded down, at least 1: half a CPU still needs a
    thread)."""
    if torch_threads is not None:
        return torch_threads
    if cpu_cores:
        return len(cpu_cores)
    return max(1, math.floor(num_cpus))


def thread_env(threads: int, intra_op: int | None = None) -> dict[str, str]:
    """The environment that holds every pool of a process to `threads`; `intra_op`, where
    given, sizes torch's intra-op threads apart from the others: OpenMP's and MKL's pools
    together, since torch sets each new thread's OpenMP pool from MKL's count (and vLLM's CPU
    attention stops an engine whose threads disagree on it: "thread_num (1 vs. 2)")."""
    env = dict.fromkeys(_POOLS, str(threads))
    if intra_op is not None:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(intra_op)
    return env
