"""Learner memory, padding and step time before and after the token head (issue 9, section 4).

    .venv/bin/python bench/learner_memory.py [--layers 24] [--time-layers 2]

For a Qwen2.5-0.5B shape (hidden 896, 14 heads, 2 KV heads, intermediate 4864, vocab 151,936,
tied head), in bf16, on the CPU:

1. bytes saved for backward per response token, counted with saved_tensors_hooks (each
   storage once; parameters excluded) over every micro-batch of the GPU probes' step (32
   groups x 8 responses, 128 prompt + 128..1024 response tokens, drawn as the probes draw
   them), split into the transformer layers (per layer), the lm head / log-prob part and the
   rest (embedding, final norm). Counting needs shapes only, so the model runs on fake
   tensors (torch's FakeTensorMode: CPU kernels' shape rules, no memory, no compute).
   With activation checkpointing a layer saves only its inputs (torch's checkpoint saves
   them through the same hooks).
   before: today's learner: the model's logits at every position, then token_stats of the
           response positions, micro-batches packed as learner/batching.py did.
   after:  the token head (learner/token_head.py) on length-sorted micro-batches, with and
           without checkpointing of the layers.
2. the padded share of the micro-batches for that step, before and after, and packed: the
   micro-batches cut for packed rows and each packed into rows as wide as its longest
   (learner.pack_sequences, the learner's default);
3. forward+backward time of a small step on the CPU in float32 (few layers, full vocab).

`--rank` instead measures real learner ranks (issue 43): DeepSpeed ZeRO-3 over `--world`
ranks (1 by default; gloo, CPU, a process each), bench/vs_trl.py's random 27M Qwen2 (hidden
512, 8 layers, a 75-token vocabulary), float32, gradient checkpointing as the job decides it
(`auto`: on at this shape), each rank with one rank's half of a step of 16 prompts x 8
responses of 6 + 256 tokens (64 sequences, 16,768 positions; `--tokens N`: N tokens a
response). Per step and rank it prints the peak resident memory (VmHWM, reset before the
step), what is resident after it, glibc's view of the heap (mallinfo2: allocated, mmapped,
and freed-but-kept) and the step's CPU time, user and system. The ranks start as a job's CPU
ranks do, with huge pages for their mapped blocks (`--no-huge-pages`: without). `--phases`
adds, per part of the step (the no-grad and grad forwards, the credit plan, the loss, the
backward, the optimizer step, the sync probe), the resident memory as it starts, its peak
and what it leaves. Run it under the real-stack lock:

    flock /tmp/realstack.lock .venv/bin/python bench/learner_memory.py --rank [--steps 2]
        [--world 2] [--phases] [--set learner.gradient_checkpointing=false ...]
        [--no-huge-pages] [--heap-blocks] [--tokens 64]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from gpu_learner_probe import SHAPES, VOCAB, groups

from groupflow.core.random_model import random_causal_lm
from groupflow.learner.batching import layout_step, pack_rows, padding_share
from groupflow.learner.token_head import install_token_head, response_positions
from groupflow.learner.token_stats import TokenStats, token_stats

SHAPE = dict(
    **SHAPES["0.5b"],
    vocab_size=VOCAB,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)
SHAPE.pop("num_hidden_layers")  # set per measurement


@dataclass
class Step:
    lengths: list[int]
    prompt_lens: list[int]
    group_ids: list[int]


def probe_step(prompts=32, group_size=8, prompt_len=128, max_response=1024, seed=0) -> Step:
    """The lengths of gpu_learner_probe.py's step (its very sequences)."""
    seqs = groups(prompts, group_size, prompt_len, max_response, seed)
    return Step(
        [len(s.input_ids) for s in seqs], [s.prompt_len for s in seqs], [s.group_id for s in seqs]
    )


def consecutive_micro_batches(step: Step, budget: int) -> list[list[int]]:
    """How learner/batching.py packed one rank's mini-batch before: sequences in group order,
    a new micro-batch when the real (unpadded) tokens would pass the budget."""
    batches: list[list[int]] = []
    used = budget
    for i in range(len(step.lengths)):
        if used + step.lengths[i] > budget:
            batches.append([])
            used = 0
        batches[-1].append(i)
        used += step.lengths[i]
    return batches


def sorted_micro_batches(step: Step, budget: int, packed: bool = False) -> list[list[int]]:
    layout = layout_step(step.lengths, step.group_ids, 1, 1, budget, packed=packed)
    return [mb for mb in layout[0][0] if mb]


def make_model(layers: int, dtype: torch.dtype, checkpointing: bool, head: bool):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = random_causal_lm(num_hidden_layers=layers, **SHAPE)
    finally:
        torch.set_default_dtype(previous)
    model.config.use_cache = False
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if head:
        install_token_head(model)
    return model


def batch(step: Step, rows: list[int], dtype: torch.dtype):
    """Token ids (B, W), the 4D additive causal+padding mask transformers builds for sdpa
    (given ready-made: on fake tensors its own check for "no padding" cannot run), positions."""
    lengths = [step.lengths[i] for i in rows]
    width = max(lengths)
    ids = torch.randint(0, SHAPE["vocab_size"], (len(rows), width))
    valid = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]  # (B, W)
    allowed = torch.ones(width, width, dtype=torch.bool).tril()[None, None] & valid[:, None, None]
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    positions = response_positions(ids, lengths, [step.prompt_lens[i] for i in rows])
    return ids, mask, positions


def stats_before(model, ids, mask, positions) -> TokenStats:
    """learner/rank.py's forward as of this issue: full logits, then the response positions."""
    logits = model(input_ids=ids, attention_mask=mask).logits
    return token_stats(logits[positions.rows, positions.cols], positions.targets, 1.0)


def stats_after(model, ids, mask, positions) -> TokenStats:
    return TokenStats(*model(input_ids=ids, attention_mask=mask, response_positions=positions))


class SavedBytes:
    """Bytes of the storages saved for backward, by the part of the model that saved them:
    "layers" from the embedding's output to the final norm (with checkpointing, what is saved
    there is each layer's inputs), "head" after the base model, "other" the rest."""

    def __init__(self, model):
        self.parts: dict[str, int] = {"layers": 0, "head": 0, "other": 0}
        self.params = {p.untyped_storage()._cdata for p in model.parameters()}
        self.seen = set(self.params)
        self.part = "other"
        base = model.model
        self.handles = [
            base.register_forward_pre_hook(lambda *_: self._set("other")),
            base.embed_tokens.register_forward_hook(lambda *_: self._set("layers")),
            base.norm.register_forward_pre_hook(lambda *_: self._set("other")),
            base.register_forward_hook(lambda *_: self._set("head")),
        ]

    def _set(self, part: str) -> None:
        self.part = part

    def next_micro_batch(self) -> None:
        """A storage freed with the last micro-batch's graph may come back at the same address."""
        self.seen = set(self.params)

    def add(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in self.seen:
            self.seen.add(storage._cdata)
            self.parts[self.part] += storage.nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.add, lambda t: t)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def count_saved(step: Step, micro: list[list[int]], layers: int, path: str, ckpt: bool):
    """Saved bytes per response token over all micro-batches, on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    tokens = 0
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = make_model(layers, torch.bfloat16, ckpt, head=path == "after")
        forward = stats_after if path == "after" else stats_before
        counter = SavedBytes(model)
        for rows in micro:
            ids, mask, positions = batch(step, rows, torch.bfloat16)
            counter.next_micro_batch()
            with counter.hooks():
                forward(model, ids, mask, positions)
            tokens += positions.rows.numel()
        counter.close()
    return {k: v / tokens for k, v in counter.parts.items()}


def time_step(step: Step, micro: list[list[int]], layers: int, path: str, ckpt: bool) -> float:
    torch.manual_seed(0)
    model = make_model(layers, torch.float32, ckpt, head=path == "after")
    forward = stats_after if path == "after" else stats_before
    batches = [batch(step, rows, torch.float32) for rows in micro]
    best = float("inf")
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        for ids, mask, positions in batches:
            forward(model, ids, mask, positions).logp.sum().backward()
        best = min(best, time.perf_counter() - start)
    return best


def packed_padding_share(micro: list[list[int]], lengths: list[int]) -> float:
    """Share of the positions that is padding once each micro-batch is packed (pack_rows)."""
    real = positions = 0
    for indices in micro:
        row_lengths = [lengths[i] for i in indices]
        real += sum(row_lengths)
        positions += pack_rows(row_lengths)[2] * max(row_lengths)
    return 1 - real / positions


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


def _heap() -> dict[str, float]:
    """glibc's heap in GB: allocated in the heap, mmapped blocks, freed but kept."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return {"heap": info.uordblks / 1e9, "mmap": info.hblkhd / 1e9, "kept": info.fordblks / 1e9}


# The parts of a step (learner/step.py's and the rank's) whose memory --rank reports: each runs
# alone, none inside another, so each one's peak is read from a peak reset as it starts.
STEP_PHASES = ("no_grad_stats", "_forward", "mini_batch_tokens", "plan_credit", "micro_batch_loss")


class PhasePeaks:
    """Per phase of a step: resident memory as it starts, its peak and what stays after it, in
    GB (the largest over the phase's calls in one step)."""

    def __init__(self, rank) -> None:
        from groupflow.learner import step

        self.rows: dict[str, tuple[float, float, float]] = {}
        for name in STEP_PHASES:
            setattr(step, name, self._watch(name, getattr(step, name)))
        policy = rank.models.policy
        for name in ("backward", "step"):
            setattr(policy, name, self._watch(f"policy.{name}", getattr(policy, name)))
        rank.probe_logprobs = self._watch("sync probe", rank.probe_logprobs)

    def _watch(self, name, fn):
        from groupflow.learner.host_memory import peak_resident_bytes, reset_peak, resident_bytes

        def watched(*args, **kwargs):
            reset_peak()
            before = resident_bytes()
            out = fn(*args, **kwargs)
            row = (before / 1e9, peak_resident_bytes() / 1e9, resident_bytes() / 1e9)
            old = self.rows.get(name)
            self.rows[name] = row if old is None or old[1] < row[1] else old
            return out

        return watched

    def take(self) -> dict[str, tuple[float, float, float]]:
        rows, self.rows = self.rows, {}
        return rows


def rank_profile(
    steps: int,
    overrides: list[str],
    world: int,
    heap_blocks: bool,
    huge_pages: bool,
    phases: bool,
    tokens: int,
) -> None:
    """Learner ranks' memory over `steps` steps of the `tokens`-token workload (see --rank), each
    rank in a process of its own with 64 sequences a step. `heap_blocks`: large blocks in
    glibc's heap, as before the rank mapped them apart; `huge_pages`: the ranks start with
    a job's CPU rank's allocator environment; `phases`: the peak of each part of the step."""
    from vs_trl import random_model

    from groupflow.learner.host_memory import allocator_env

    root = Path(tempfile.mkdtemp())
    model = random_model(root)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if huge_pages:  # read by glibc as a process starts: the spawned ranks start with it
        os.environ.update(allocator_env())
    else:
        os.environ.pop("GLIBC_TUNABLES", None)
    torch.multiprocessing.start_processes(
        _profile_rank,
        args=(world, port, model, overrides, steps, heap_blocks, phases, tokens),
        nprocs=world,
        start_method="spawn",
    )


def _profile_rank(
    rank_index: int,
    world: int,
    port: int,
    model: Path,
    overrides: list[str],
    steps: int,
    heap_blocks: bool,
    phases: bool,
    tokens: int,
) -> None:
    from groupflow.config.load import validate_config
    from groupflow.core.device import device_for
    from groupflow.core.records import TrainSequence
    from groupflow.learner.host_memory import peak_resident_bytes, reset_peak, resident_bytes
    from groupflow.learner.rank import LearnerRank
    from groupflow.learner.zero_models import RankSetup

    def say(line: str) -> None:
        print(f"[rank {rank_index}/{world}] {line}", flush=True)

    # the job's shape (bench/vs_trl.py's at `tokens` tokens), for what the rank decides from it
    workload = [
        "rollout.prompts_per_step=16",
        "rollout.group_size=8",
        f"rollout.sampling.max_tokens={tokens}",
        f"rollout.max_model_len={tokens + 64}",
    ]
    cfg = validate_config(None, [f"model.path={model}", *workload, *overrides])
    torch.set_num_threads(cfg.learner.resources.threads)  # as a job's rank (actors/learner.py)
    say(
        f"process before the rank: {resident_bytes() / 1e9:.2f} GB resident, "
        f"{cfg.learner.resources.threads} threads, checkpointing "
        f"{cfg.learner.gradient_checkpointing}"
    )
    setup = RankSetup(str(model), rank_index, world, "127.0.0.1", port, device_for(0))
    rank = LearnerRank(setup, cfg)
    if heap_blocks:  # where glibc's own threshold rises once a step's activations are freed
        ctypes.CDLL("libc.so.6").mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
    say(f"rank built: {resident_bytes() / 1e9:.2f} GB resident, {_heap()}")
    say(f"micro_batch_tokens {cfg.learner.micro_batch_tokens}: budget {rank.micro_batch_tokens()}")
    say(rank.checkpointing_line)
    watched = None
    if phases:
        # Each part's peak is read from a peak reset as it starts, which leaves the rank's own
        # reading of the step's peak short: the rank keeps its estimated budget instead.
        watched = PhasePeaks(rank)
        rank.budget_measured = True
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for group in range(8 * world):  # 64 sequences a rank, one rank's half of the job's step
        advantages = torch.randn(8, generator=gen).tolist()
        for advantage in advantages:
            ids = torch.randint(3, 75, (6 + tokens,), generator=gen).tolist()
            behaviour = (-torch.rand(tokens, generator=gen)).tolist()
            seqs.append(TrainSequence(ids, 6, advantage, group, 0, behaviour))
    for step in range(steps):
        budget = cfg.learner.micro_batch_tokens
        budget = budget if budget != "auto" else max(1, rank.micro_batch_tokens()[0])
        layout = layout_step(
            [len(s.input_ids) for s in seqs], [s.group_id for s in seqs], world, 1, budget, True
        )
        share = [[[seqs[i] for i in mb] for mb in mini] for mini in layout[rank_index]]
        reset_peak()
        started, cpu = time.perf_counter(), os.times()
        rank.train_step(share)
        heap, cpu_after = _heap(), os.times()
        rows = watched.take() if watched is not None else {}
        peak = max([peak_resident_bytes(), *(row[1] * 1e9 for row in rows.values())])
        say(
            f"step {step}: {[len(mb) for mb in share[0]]} sequences a micro-batch, "
            f"{time.perf_counter() - started:.0f} s (CPU {cpu_after.user - cpu.user:.0f} s user, "
            f"{cpu_after.system - cpu.system:.0f} s system); peak {peak / 1e9:.2f} GB, "
            f"after {resident_bytes() / 1e9:.2f} GB (heap {heap['heap']:.2f} allocated, "
            f"{heap['kept']:.2f} freed but kept, mmapped {heap['mmap']:.2f})"
        )
        for name, (before, peak, after) in rows.items():
            say(f"  {name:<18} from {before:.2f} GB, peak {peak:.2f} GB, leaves {after:.2f} GB")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=24, help="layers for the byte count")
    parser.add_argument("--time-layers", type=int, default=2, help="layers for the timing")
    parser.add_argument("--rank", action="store_true", help="a real rank's memory (issue 43)")
    parser.add_argument("--steps", type=int, default=2, help="steps of --rank")
    parser.add_argument("--world", type=int, default=1, help="ranks of --rank (1 process each)")
    parser.add_argument(
        "--tokens", type=int, default=256, help="--rank: the response length (forced) of the job"
    )
    parser.add_argument("--set", action="append", default=[], help="config key=value (--rank)")
    parser.add_argument(
        "--phases", action="store_true", help="--rank: the peak of each part of the step"
    )
    parser.add_argument(
        "--no-huge-pages",
        action="store_true",
        help="--rank without a CPU rank's huge pages (learner/host_memory.py allocator_env)",
    )
    parser.add_argument(
        "--heap-blocks",
        action="store_true",
        help="--rank with large blocks in glibc's heap (its threshold risen to 32 MiB), as "
        "before a rank mapped them apart (learner/host_memory.py)",
    )
    args = parser.parse_args()
    if args.rank:
        rank_profile(
            args.steps,
            args.set,
            args.world,
            args.heap_blocks,
            not args.no_huge_pages,
            args.phases,
            args.tokens,
        )
        return

    step = probe_step()
    response = sum(n - p for n, p in zip(step.lengths, step.prompt_lens, strict=True))
    print(
        f"probe step: {len(step.lengths)} sequences, {sum(step.lengths)} tokens, {response} response"
    )

    print("\npadded share of the micro-batches (1 rank, 1 mini-batch)")
    print(
        f"{'micro_batch_tokens':>18} {'before':>8} {'after':>8} {'packed':>8} "
        f"{'micro-batches b/a/p':>20}"
    )
    for budget in (16384, 8192, 4096):
        before = consecutive_micro_batches(step, budget)
        after = sorted_micro_batches(step, budget)
        packed = sorted_micro_batches(step, budget, packed=True)
        print(
            f"{budget:>18} {padding_share([[before]], step.lengths):>8.1%} "
            f"{padding_share([[after]], step.lengths):>8.1%} "
            f"{packed_padding_share(packed, step.lengths):>8.1%} "
            f"{len(before):>9}/{len(after)}/{len(packed)}"
        )

    rows = {
        "before (full logits)": ("before", False, consecutive_micro_batches),
        "after (token head)": ("after", False, sorted_micro_batches),
        "after (token head + checkpointing)": ("after", True, sorted_micro_batches),
    }
    for budget in (16384, 4096):
        print(f"\nbytes saved for backward per response token, bf16, micro_batch_tokens {budget}")
        print(f"{'setting':<34} {'per layer':>10} {'head+logp':>10} {'other':>8} {'total':>10}")
        head_before = None
        for name, (path, ckpt, layout) in rows.items():
            per = count_saved(step, layout(step, budget), args.layers, path, ckpt)
            total = per["layers"] + per["head"] + per["other"]
            head_before = head_before or per["head"]
            print(
                f"{name:<34} {per['layers'] / args.layers:>10,.0f} {per['head']:>10,.0f} "
                f"{per['other']:>8,.0f} {total:>10,.0f}   head: {per['head'] / head_before:.2%} "
                "of before"
            )

    small = probe_step(prompts=2, group_size=4, prompt_len=8, max_response=64, seed=1)
    small_budget = 256
    print(
        f"\nforward+backward of a small step on the CPU, float32, {args.time_layers} layers, "
        f"{len(small.lengths)} sequences of 8 prompt + 8..64 response tokens, "
        f"micro_batch_tokens {small_budget}"
    )
    for name, (path, ckpt, layout) in rows.items():
        seconds = time_step(small, layout(small, small_budget), args.time_layers, path, ckpt)
        print(f"{name:<34} {seconds:>8.2f} s")


if __name__ == "__main__":
    main()
