"""learner.micro_batch_tokens: auto (learner/memory_budget.py): the budget from the memory a
rank may use and the model's bytes per position, the measured first step in its place; and
a rank's host memory figures (learner/host_memory.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from transformers import Qwen2Config

from groupflow.config.base import ConfigError
from groupflow.config.job import Config
from groupflow.learner.host_memory import (
    allocator_env,
    peak_resident_bytes,
    release_freed_memory,
    reset_peak,
    resident_bytes,
)
from groupflow.learner.memory_budget import (
    GIB,
    ModelShape,
    bytes_per_position,
    check_longest_fits,
    choose_checkpointing,
    estimated_budget,
    fixed_bytes,
    measured_budget,
    mini_batch_share,
    rank_memory_bytes,
)

# bench/vs_trl.py's random 27M Qwen2
SHAPE = ModelShape.of(
    Qwen2Config(hidden_size=512, intermediate_size=1536, num_hidden_layers=8), 27_000_000
)


def test_checkpointing_keeps_a_layers_input_a_position_instead_of_its_activations():
    with_ckpt = bytes_per_position(SHAPE, 4, checkpointing=True)
    without = bytes_per_position(SHAPE, 4, checkpointing=False)
    assert without > 5 * with_ckpt
    assert bytes_per_position(SHAPE, 2, checkpointing=True) == pytest.approx(with_ckpt / 2, 1e-3)
    # the 27M model in float32: tens of kB a position, so 16k positions cost about 1.5 GB
    assert 40_000 < with_ckpt < 150_000


def test_the_memory_a_rank_may_use():
    assert rank_memory_bytes(3.5, 24 * GIB, 0, 2) == int(3.5 * GIB)  # learner.memory_gib
    assert rank_memory_bytes(None, 24 * GIB, 0, 2) == 6 * GIB  # half the node, shared
    assert rank_memory_bytes(None, 24 * GIB, 80 * GIB, 2) == int(72 * GIB)  # its GPU's 90%


def test_the_budget_is_the_room_left_over_the_cost_of_a_position():
    fixed = fixed_bytes(SHAPE, 4, 2, baseline=GIB)
    assert fixed == GIB + 27_000_000 * 4 + 27_000_000 * 8
    per = bytes_per_position(SHAPE, 4, True)
    assert estimated_budget(6 * GIB, fixed, per) == (6 * GIB - fixed) // per
    assert estimated_budget(GIB, fixed, per) == 0  # not even a position fits


def test_the_measured_step_replaces_the_estimate():
    # a step from 1.5 GB resident peaked at 3.5 GB over micro-batches of 16,000 positions:
    # 125 kB a position; 80% of the 4.5 GiB left holds 3.6 GB / 125 kB of them
    before, peak = 1_500_000_000, 3_500_000_000
    budget = measured_budget(6 * GIB, before, peak, 16_000)
    assert budget == int((6 * GIB - before) * 0.8) // 125_000
    assert measured_budget(GIB, before, peak, 16_000) == 0


def test_a_sequence_that_cannot_fit_is_refused_in_one_line_naming_its_length_and_the_setting():
    check_longest_fits(4096, 4096, 2.0)  # fits alone
    with pytest.raises(ConfigError) as refused:
        check_longest_fits(1843, 4096, 1.5)
    line = str(refused.value)
    assert "\n" not in line
    assert "up to 4096 tokens (rollout.max_model_len)" in line
    assert "learner.memory_gib=1.5" in line and "learner.micro_batch_tokens: auto" in line


def test_auto_is_the_default_and_a_number_still_works():
    cfg = Config()
    assert cfg.learner.micro_batch_tokens == "auto" and cfg.learner.memory_gib is None
    cfg.learner.micro_batch_tokens = 4096
    assert cfg.learner.micro_batch_tokens == 4096
    with pytest.raises(ValueError, match="auto or at least 1"):
        cfg.learner.micro_batch_tokens = 0


def test_a_ranks_share_of_a_mini_batch_counts_its_sequences_at_the_longest_length():
    # 16 prompts x 8 over 2 ranks, 1 mini-batch: 64 sequences of up to 320 tokens each
    assert mini_batch_share(128, 2, 1, 320, 1) == 64 * 320
    assert mini_batch_share(128, 2, 2, 320, 1) == 32 * 320  # two mini-batches
    assert mini_batch_share(129, 2, 1, 320, 1) == 65 * 320  # an odd sequence out: a rank's more
    # sequence parallel 2 over 4 ranks: 2 groups of 64 sequences, a row at half its width
    assert mini_batch_share(128, 4, 1, 321, 2) == 64 * 161


@pytest.mark.parametrize(
    ("share", "memory_gib", "on"),
    [(20_480, 6, True), (8_192, 6, False), (20_480, 24, False), (8_192, 1.5, True)],
)
def test_auto_checkpointing_is_on_where_a_share_needs_more_than_one_micro_batch_without_it(
    share, memory_gib, on
):
    memory = int(memory_gib * GIB)
    fixed = fixed_bytes(SHAPE, 4, 2, baseline=GIB // 2)
    without = estimated_budget(memory, fixed, bytes_per_position(SHAPE, 4, False))
    choice = choose_checkpointing(memory, fixed, SHAPE, 4, share)
    assert choice.on is on and choice.on == (share > without)
    assert (choice.share, choice.without, choice.memory) == (share, without, memory)
    line = choice.line()
    assert "\n" not in line
    assert line.startswith(f"gradient checkpointing {'on' if on else 'off'} (auto: ")
    assert f"{share:,} positions" in line and f"{memory_gib:.1f} GiB" in line


def test_gradient_checkpointing_is_auto_by_default_and_strictly_a_switch_or_auto():
    cfg = Config()
    assert cfg.learner.gradient_checkpointing == "auto"
    for setting in (True, False, "auto"):
        cfg.learner.gradient_checkpointing = setting
        assert cfg.learner.gradient_checkpointing == setting
    for bad in ("yes", 1, "on"):
        with pytest.raises(ValueError):
            cfg.learner.gradient_checkpointing = bad


FRAGMENTED_HEAP = """
import ctypes, sys
import torch
from groupflow.learner.host_memory import release_freed_memory, resident_bytes
# Blocks of up to 32 MiB in the heap, as glibc does once it freed one that large, with a small
# block after them, so the freed ones are not at the heap's top (where glibc trims on its own).
ctypes.CDLL("libc.so.6").mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
blocks = [torch.ones(1 << 20) for _ in range(64)]  # 4 MiB each
pin = torch.ones(1 << 18)  # 1 MiB: from the top, none of the freed blocks exists yet
held = resident_bytes()
del blocks
kept = resident_bytes()
if sys.argv[1] == "release":
    release_freed_memory()
print(held, kept, resident_bytes())
"""


# One process imports torch (seconds of CPU), then forks a child per mode that runs the script
# as a fresh process would after its imports: nothing between the import and the fork touches
# the heap, so each child starts from the malloc state a fresh process has there.
FORKING_RUNNER = """
import os, sys
import torch
script, modes = sys.argv[1], sys.argv[2:]
for mode in modes:
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        sys.argv = ["-c", mode]
        exec(compile(script, "<script>", "exec"), {"__name__": "__main__"})
        sys.stdout.flush()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, mode
    print("--", flush=True)
"""


def both(script: str, *modes: str) -> dict[str, str]:
    """`script`'s output in each mode, each in a process of its own."""
    run = subprocess.run(
        [sys.executable, "-c", FORKING_RUNNER, script, *modes],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    outs = run.stdout.split("--\n")[: len(modes)]
    return dict(zip(modes, outs, strict=True))


def test_a_micro_batchs_freed_pages_go_back_to_the_system():
    """256 MiB freed inside the heap stay resident (glibc keeps them for later blocks) until
    release_freed_memory hands them back, as a rank does after each micro-batch."""
    runs = {
        mode: [int(v) for v in out.split()]
        for mode, out in both(FRAGMENTED_HEAP, "keep", "release").items()
    }
    held, kept, after = runs["keep"]
    assert kept > held - (64 << 20) and after == kept  # freed, yet resident
    held, kept, after = runs["release"]
    assert after < held - (192 << 20)


ACTIVATIONS = """
import sys
import torch
from groupflow.learner.host_memory import map_large_blocks, resident_bytes
if sys.argv[1] == "mapped":
    map_large_blocks()
torch.ones(4 << 20)  # a 16 MiB block freed: glibc's threshold rises to it
before = resident_bytes()
# A micro-batch's activations (1 to 4 MiB each), freed at its end while one stays
blocks = [torch.ones((1 + i % 4) << 18) for i in range(96)]
kept = blocks[-1]
del blocks
print(before, resident_bytes())
"""


def test_a_micro_batchs_large_blocks_are_unmapped_when_freed():
    """With large blocks mapped apart (as a CPU rank runs), what a micro-batch freed leaves
    the process at once; in glibc's heap, at its risen threshold, it stays resident."""
    grown = {}
    for mode, out in both(ACTIVATIONS, "heap", "mapped").items():
        before, after = (int(v) for v in out.split())
        grown[mode] = after - before
    assert grown["heap"] > 150 << 20  # of the 240 MiB freed, most stays
    assert grown["mapped"] < 16 << 20


def test_peak_resident_memory_starts_afresh():
    reset_peak()
    now = resident_bytes()
    assert now > 0 and peak_resident_bytes() >= now
    block = torch.ones(64 << 20)  # 256 MiB, touched
    assert peak_resident_bytes() >= now + (200 << 20)
    del block
    release_freed_memory()
    reset_peak()
    assert peak_resident_bytes() < now + (200 << 20)


HUGE_PAGES = """
import torch
from groupflow.learner.host_memory import map_large_blocks
map_large_blocks()
block = torch.ones(16 << 20)  # 64 MiB of activations, touched
with open("/proc/self/smaps_rollup") as rollup:
    print(next(int(line.split()[1]) for line in rollup if line.startswith("AnonHugePages:")))
"""


def test_a_cpu_ranks_allocator_env_maps_large_blocks_on_huge_pages():
    """A CPU rank starts with allocator_env (actors/learner.py): glibc then asks for
    transparent huge pages on its mapped blocks, where the kernel grants them on request."""
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as setting:
        mode = setting.read().split("[")[1].split("]")[0]
    huge = {}
    for name, extra in (("plain", {}), ("rank", allocator_env())):
        env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
        run = subprocess.run(
            [sys.executable, "-c", HUGE_PAGES],
            env={**env, **extra},
            capture_output=True,
            text=True,
        )
        assert run.returncode == 0, run.stderr[-2000:]
        huge[name] = int(run.stdout) << 10
    if mode == "never":
        assert huge == {"plain": 0, "rank": 0}
    else:
        assert huge["rank"] >= 32 << 20, (mode, huge)
    if mode == "madvise":
        assert huge["plain"] < 8 << 20, huge  # only what is asked for
