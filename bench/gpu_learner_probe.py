"""The learner rank on one CUDA GPU with a real model shape: no Ray, no vLLM.

    python3 bench/gpu_learner_probe.py SHAPE MICRO_TOKENS SETTING... [--set key=value ...]
        [--heads fused,chunked] [--moe-leaf off,on] [--profile] [--out FILE.jsonl]
        [--prompts 32] [--max-response 1024] [--device cuda|cpu] [--peak-tflops N]

Builds a random-init model (`0.5b`, `1.5b`: Qwen2.5 shapes, vocab 151,936, tied head;
`30b-a3b-2l`: two layers of Qwen3-30B-A3B at its real widths, 128 experts, top-8, untied
head; `tiny`, `moe-tiny`: for a smoke test on the CPU), makes 32 groups x 8 responses (128
prompt tokens, 128 to 1024 response tokens) and times `LearnerRank.train_step` under
DeepSpeed ZeRO-3 at world size 1 in bf16, the micro-batches laid out as the learner group
lays them out. A SETTING is a preset name; `+diag` turns the cancellation diagnostic on
(`grpo`, `grpo+diag`, `stapo`, `lopti`, ...). Each setting runs once per token head
(`--heads`: `fused` is the learner's own choice, Triton kernels on CUDA; `chunked` is its
chunked reference head, the CUDA path before the fused head) and, for a mixture of experts,
once per `--moe-leaf` (`learner.moe.leaf_modules`: `on`, the default of a job, makes each
sparse MoE block a ZeRO-3 leaf module, gathered whole; learner/moe_blocks.py).

One JSON line per run (and appended to `--out`): step times (the first pays warm-up),
tokens/s, share of the card's bf16 dense peak (989 TFLOP/s for an H100 or H200 SXM; counting
2N FLOPs a token for a proximal forward and 6N per optimizer pass, plus 2N per token again
when activation checkpointing recomputes the forward, N the parameters a token multiplies
by: a mixture's experts count top-k of them, an untied input embedding none), peak GPU
memory, the padded share of the micro-batches, and the host synchronisations of one more
step (torch.cuda.set_sync_debug_mode: `syncs_per_step`, per micro-batch, the five call sites
that made most of them and those that synchronised at least once per micro-batch).
`--profile` profiles one more step of the first run and reports its top GPU entries.
`STEPS=2` shortens it.

Needs torch, transformers, DeepSpeed and pydantic, and the project importable as `groupflow`
(`pip install --no-deps .`, or bench/gpu_suite.sh's way). Run one shape per process.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import socket
import time
import warnings
from collections import Counter

import torch

from groupflow.core.device import Device
from groupflow.core.random_model import random_causal_lm
from groupflow.core.records import TrainSequence
from groupflow.learner import token_head
from groupflow.learner.batching import layout_step, padding_share
from groupflow.learner.rank import LearnerRank
from groupflow.learner.zero_models import RankSetup
from groupflow.run.job_config import build_config

SHAPES = {  # Qwen2.5 shapes
    "0.5b": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
    ),
    "1.5b": dict(
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
    ),
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2),
}
MOE_SHAPES = {  # Qwen3-MoE shapes (Qwen3-30B-A3B's config.json, two of its 48 layers)
    "30b-a3b-2l": dict(
        hidden_size=2048,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    "moe-tiny": dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=8,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    ),
}
VOCAB = 151_936
SMOKE_VOCAB = {"tiny": 512, "moe-tiny": 512}  # a CPU's step in seconds
H100_SXM_BF16_TFLOPS = 989  # dense; the H200 is the same chip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def card_peak_tflops(device: str) -> float | None:
    """The card's dense bf16 peak by its name: SXM H100 and H200 989, NVL 835, PCIe 756."""
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    if "H100" not in name and "H200" not in name:
        return None
    return 756.0 if "PCIe" in name else 835.0 if "NVL" in name else H100_SXM_BF16_TFLOPS


def random_moe_lm(vocab_size: int, **shape) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=vocab_size, **shape))


def flop_parameters(model: torch.nn.Module) -> int:
    """The parameters a token's forward multiplies by (2 FLOPs each): all of them, less an
    input embedding that is not the head's (a lookup) and the experts a token is not routed to."""
    n = sum(p.numel() for p in model.parameters())
    if model.get_input_embeddings().weight is not model.get_output_embeddings().weight:
        n -= model.get_input_embeddings().weight.numel()
    experts = getattr(model.config, "num_experts", None)
    if experts:
        routed = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
        n -= routed * (experts - model.config.num_experts_per_tok) // experts
    return n


def build(shape: str, path: str, device: str) -> tuple[int, int]:
    """Save a random-init model of `shape` at `path` (initialised on `device`: quicker on a
    GPU); its parameter count and the parameters a token multiplies by."""
    torch.manual_seed(0)
    vocab = SMOKE_VOCAB.get(shape, VOCAB)
    with torch.device(device):
        if shape in MOE_SHAPES:
            model = random_moe_lm(vocab, max_position_embeddings=4096, **MOE_SHAPES[shape])
        else:
            model = random_causal_lm(
                vocab, max_position_embeddings=4096, tie_word_embeddings=True, **SHAPES[shape]
            )
    model = model.to(torch.bfloat16)
    model.save_pretrained(path)
    counts = sum(p.numel() for p in model.parameters()), flop_parameters(model)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return counts


def groups(
    n_prompts: int,
    group_size: int,
    prompt_len: int,
    max_response: int,
    seed: int,
    vocab: int = VOCAB,
):
    """GRPO groups of random tokens (100 to 150,000, or to a smaller vocabulary's end) with
    0/1 rewards and the probe's length mix."""
    top = min(150_000, vocab)
    rng = random.Random(seed)
    seqs = []
    for g in range(n_prompts):
        prompt = [rng.randrange(100, top) for _ in range(prompt_len)]
        rewards = [float(rng.random() < 0.5) for _ in range(group_size)]
        mean = sum(rewards) / group_size
        std = (sum((r - mean) ** 2 for r in rewards) / max(group_size - 1, 1)) ** 0.5 or 1.0
        for r in rewards:
            length = rng.randint(max_response // 8, max_response)
            response = [rng.randrange(100, top) for _ in range(length)]
            seqs.append(
                TrainSequence(
                    input_ids=prompt + response,
                    prompt_len=prompt_len,
                    advantage=(r - mean) / std,
                    group_id=g,
                    policy_version=0,
                    vllm_logprobs=[],
                )
            )
    return seqs


def count_syncs(step) -> tuple[int, Counter[str]]:
    """Host synchronisations torch flags while `step` runs (item, tolist, device-to-host
    and pageable copies, value-sized results), by call site."""
    sites: Counter[str] = Counter()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchronizing" in str(w.message):
            sites[f"{w.filename}:{w.lineno}"] += 1
    return sum(sites.values()), sites


def sync_figures(step, micro_batches: int, device: str) -> dict:
    if device != "cuda":  # the sync debug mode watches CUDA streams only
        return dict(syncs_per_step=None, syncs_per_micro_batch=None, sync_sites=[])
    syncs, sites = count_syncs(step)
    return dict(
        syncs_per_step=syncs,
        syncs_per_micro_batch=round(syncs / micro_batches, 2),
        sync_sites=sites.most_common(5),
        # Sites that synchronised at least once per micro-batch: the micro-batch loop's own.
        per_micro_batch_sites=[(s, n) for s, n in sites.most_common() if n >= micro_batches],
    )


def profile_figures(step, device: str, top: int = 10) -> dict:
    """One step under torch.profiler: the kernels with most GPU time, the operators that
    launched most GPU time, and the operators with most host time of their own (ZeRO-3's
    hooks, Python), each with its share of the step's GPU or host total."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    started = time.time()
    with profile(activities=activities) as prof:
        step()
        if device == "cuda":
            torch.cuda.synchronize()
    wall_ms = (time.time() - started) * 1e3
    events = prof.key_averages()
    host = [e for e in events if e.device_type == DeviceType.CPU]
    kernels = [
        e
        for e in events
        if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)
    ]
    gpu_us = sum(e.self_device_time_total for e in kernels)
    host_us = sum(e.self_cpu_time_total for e in host)

    def ranked(chosen, key: str, total_us: float) -> list[dict]:
        chosen = sorted((e for e in chosen if getattr(e, key) > 0), key=lambda e: -getattr(e, key))
        return [
            dict(
                name=e.key[:100],
                ms=round(getattr(e, key) / 1e3, 1),
                share=round(getattr(e, key) / (total_us or 1), 3),
                calls=e.count,
            )
            for e in chosen[:top]
        ]

    return dict(
        profile_step_ms=round(wall_ms, 1),  # the profiler's own overhead included
        profile_gpu_ms=round(gpu_us / 1e3, 1),
        profile_host_ms=round(host_us / 1e3, 1),
        profile_kernels=ranked(kernels, "self_device_time_total", gpu_us),
        profile_ops_by_gpu=ranked(host, "self_device_time_total", gpu_us),
        profile_ops_by_host=ranked(host, "self_cpu_time_total", host_us),
    )


CHOOSE_TOKEN_HEAD = token_head.head_stats_function


def use_token_head(kind: str) -> None:
    """`fused`: the learner's own choice (Triton kernels on CUDA, the chunked head elsewhere);
    `chunked`: the chunked reference head on any device."""
    if kind == "fused":
        token_head.head_stats_function = CHOOSE_TOKEN_HEAD
    else:
        token_head.head_stats_function = lambda device: token_head._ChunkedHeadStats.apply


def probe(run: dict, path: str, flop_params: int, seqs, args) -> dict:
    preset, _, diag = run["setting"].partition("+")
    cfg = build_config(
        {
            "algorithm": {"preset": preset, "cancellation_diagnostic": diag == "diag"},
            "learner": {
                "num_ranks": 1,
                "micro_batch_tokens": args.micro_batch_tokens,
                # each sparse MoE block a ZeRO-3 leaf module, or not (no effect on a dense model)
                "moe": {"leaf_modules": run.get("moe_leaf") == "on"},
            },
            "model": {"dtype": "bfloat16"},
        },
        args.overrides,
    )
    use_token_head(run["token_head"])
    cuda = args.device == "cuda"
    allocated_before = torch.cuda.memory_allocated() / 2**30 if cuda else None
    setup = RankSetup(path, 0, 1, "127.0.0.1", free_port(), Device(args.device))
    started = time.time()
    rank = LearnerRank(setup, cfg)
    init_s = time.time() - started
    lengths = [len(s.input_ids) for s in seqs]
    layout = layout_step(
        lengths,
        [s.group_id for s in seqs],
        1,
        cfg.learner.mini_batches_per_step,
        args.micro_batch_tokens,
        packed=cfg.learner.pack_sequences,
    )
    share = [[[seqs[i] for i in mb] for mb in mini] for mini in layout[0]]
    micro_batches = sum(len(mini) for mini in layout[0])
    times = []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        for _ in range(int(os.environ.get("STEPS", 3))):
            if cuda:
                torch.cuda.synchronize()
            t = time.time()
            figures = rank.train_step(share)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.time() - t)
        syncs = sync_figures(lambda: rank.train_step(share), micro_batches, args.device)
        peak_gib = round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None
        profiled = (
            profile_figures(lambda: rank.train_step(share), args.device) if run["profile"] else {}
        )
    except Exception as err:  # report and go on with the next run
        return dict(run, error=repr(err)[:600], step_s=[round(t, 2) for t in times])
    finally:
        rank.models.policy.zero_model.destroy()
    step_s = min(times[1:] or times)
    ntok = sum(lengths)
    passes = figures.optimizer_updates
    recompute = 2 * passes if cfg.learner.gradient_checkpointing else 0
    flops = (2 + 6 * passes + recompute) * flop_params * ntok
    peak = args.peak_tflops
    return dict(
        run,
        micro_batch_tokens=args.micro_batch_tokens,
        gradient_checkpointing=cfg.learner.gradient_checkpointing,
        init_s=round(init_s, 1),
        step_s=[round(t, 2) for t in times],
        tokens_per_s=round(ntok / step_s),
        tflops=round(flops / step_s / 1e12, 1),
        mfu=round(flops / step_s / (peak * 1e12), 3) if peak else None,
        peak_gib=peak_gib,
        allocated_before_gib=round(allocated_before, 2) if cuda else None,
        padding=round(padding_share(layout, lengths), 3),
        micro_batches=micro_batches,
        updates=passes,
        **syncs,
        **profiled,
    )


def runs(args) -> list[dict]:
    """The runs of this process, in order: setting x token head x leaf modules."""
    leaves = args.moe_leaf if args.shape in MOE_SHAPES else [None]
    out = []
    for setting in args.settings:
        for head in args.heads:
            for leaf in leaves:
                run = dict(shape=args.shape, setting=setting, token_head=head)
                if leaf is not None:
                    run["moe_leaf"] = leaf
                out.append(dict(run, profile=args.profile and not out))
    return out


def listed(allowed: set[str]):
    def parse(text: str) -> list[str]:
        items = [t for t in text.split(",") if t]
        if not items or not set(items) <= allowed:
            raise argparse.ArgumentTypeError(f"{text!r}: a comma list of {sorted(allowed)}")
        return items

    return parse


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("shape", choices=sorted(SHAPES) + sorted(MOE_SHAPES))
    parser.add_argument("micro_batch_tokens", type=int)
    parser.add_argument("settings", nargs="+")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--heads", type=listed({"fused", "chunked"}), default=["fused"])
    parser.add_argument("--moe-leaf", type=listed({"off", "on"}), default=["off"])
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", help="append each JSON line to this file too")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-response", type=int, default=1024)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--peak-tflops", type=float, help="default: by the card's name")
    args = parser.parse_args()
    if args.peak_tflops is None:
        args.peak_tflops = card_peak_tflops(args.device)
    path = f"/tmp/probe-{args.shape}"
    nparams, flop_params = build(args.shape, path, args.device)
    seqs = groups(args.prompts, 8, 128, args.max_response, 0, SMOKE_VOCAB.get(args.shape, VOCAB))
    head = dict(
        shape=args.shape,
        device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        peak_tflops=args.peak_tflops,
        params=nparams,
        flop_params=flop_params,
        seqs=len(seqs),
        tokens=sum(len(s.input_ids) for s in seqs),
        response_tokens=sum(s.num_response_tokens for s in seqs),
        overrides=args.overrides,
    )
    emit(head, args.out)
    for run in runs(args):
        try:
            result = probe(run, path, flop_params, seqs, args)
        except Exception as err:  # a rank that fails to start: report, go on with the next run
            result = dict(run, error=repr(err)[:600])
        emit(result, args.out)
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()


def emit(record: dict, out: str | None) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
