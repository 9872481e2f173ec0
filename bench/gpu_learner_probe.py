"""The learner rank on one CUDA GPU with a real model shape: no Ray, no vLLM.

    python3 bench/gpu_learner_probe.py SHAPE MICRO_TOKENS SETTING... [--set key=value ...]

Builds a random-init Qwen2.5 shape (`0.5b` or `1.5b`, vocab 151,936, tied head), makes 32
groups x 8 responses (128 prompt tokens, 128 to 1024 response tokens) and times
`LearnerRank.train_step` under DeepSpeed ZeRO-3 at world size 1 in bf16, the micro-batches
laid out as the learner group lays them out. A SETTING is a preset name; `+diag` turns the
cancellation diagnostic on (`grpo`, `grpo+diag`, `stapo`, `lopti`, ...). One JSON line per
setting: step times (the first pays warm-up), tokens/s, share of the H100 bf16 dense peak
(989 TFLOP/s, counting 2N FLOPs a token for a proximal forward when one runs and 6N per
optimizer pass, plus 2N per token again when activation checkpointing recomputes the
forward), peak GPU memory, the padded share of the micro-batches, and the host
synchronisations of one more step (torch.cuda.set_sync_debug_mode: `syncs_per_step`, and
the five call sites that made most of them). `STEPS=2` shortens it.

Needs torch, transformers, DeepSpeed and pydantic, and the project importable as `groupflow`
(`pip install --no-deps .`). Run one setting per process for a clean memory peak.
"""

from __future__ import annotations

import argparse
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
}
VOCAB = 151_936
PEAK_FLOPS = 989e12  # H100 SXM bf16 dense


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def build(shape: str, path: str) -> int:
    model = random_causal_lm(
        VOCAB, seed=0, max_position_embeddings=4096, tie_word_embeddings=True, **SHAPES[shape]
    ).to(torch.bfloat16)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def groups(n_prompts: int, group_size: int, prompt_len: int, max_response: int, seed: int):
    """GRPO groups of random tokens with 0/1 rewards and the probe's length mix."""
    rng = random.Random(seed)
    seqs = []
    for g in range(n_prompts):
        prompt = [rng.randrange(100, 150_000) for _ in range(prompt_len)]
        rewards = [float(rng.random() < 0.5) for _ in range(group_size)]
        mean = sum(rewards) / group_size
        std = (sum((r - mean) ** 2 for r in rewards) / max(group_size - 1, 1)) ** 0.5 or 1.0
        for r in rewards:
            length = rng.randint(max_response // 8, max_response)
            response = [rng.randrange(100, 150_000) for _ in range(length)]
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


def count_syncs(step) -> tuple[int, list[tuple[str, int]]]:
    """Host synchronisations torch flags while `step` runs (item, tolist, device-to-host
    and pageable copies, value-sized results), and the five call sites with most of them."""
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
    return sum(sites.values()), sites.most_common(5)


def probe(setting: str, path: str, nparams: int, seqs, micro: int, overrides: list[str]) -> dict:
    preset, _, diag = setting.partition("+")
    cfg = build_config(
        {
            "algorithm": {"preset": preset, "cancellation_diagnostic": diag == "diag"},
            "learner": {"num_ranks": 1, "micro_batch_tokens": micro},
            "model": {"dtype": "bfloat16"},
        },
        overrides,
    )
    setup = RankSetup(path, 0, 1, "127.0.0.1", free_port(), Device("cuda"))
    started = time.time()
    rank = LearnerRank(setup, cfg)
    init_s = time.time() - started
    lengths = [len(s.input_ids) for s in seqs]
    layout = layout_step(
        lengths,
        [s.group_id for s in seqs],
        1,
        cfg.learner.mini_batches_per_step,
        micro,
        packed=cfg.learner.pack_sequences,
    )
    share = [[[seqs[i] for i in mb] for mb in mini] for mini in layout[0]]
    times = []
    torch.cuda.reset_peak_memory_stats()
    try:
        for _ in range(int(os.environ.get("STEPS", 3))):
            torch.cuda.synchronize()
            t = time.time()
            figures = rank.train_step(share)
            torch.cuda.synchronize()
            times.append(time.time() - t)
        syncs, sites = count_syncs(lambda: rank.train_step(share))
    except Exception as err:  # report and go on with the next setting
        return dict(setting=setting, error=repr(err)[:600], step_s=times)
    step_s = min(times[1:] or times)
    ntok = sum(lengths)
    passes = figures.optimizer_updates
    recompute = 2 * passes if cfg.learner.gradient_checkpointing else 0
    flops = (2 + 6 * passes + recompute) * nparams * ntok
    out = dict(
        setting=setting,
        micro_batch_tokens=micro,
        init_s=round(init_s, 1),
        step_s=[round(t, 2) for t in times],
        tokens_per_s=round(ntok / step_s),
        mfu=round(flops / step_s / PEAK_FLOPS, 3),
        peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1),
        padding=round(padding_share(layout, lengths), 3),
        micro_batches=len(layout[0][0]),
        updates=passes,
        syncs_per_step=syncs,
        sync_sites=sites,
    )
    rank.models.policy.zero_model.destroy()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("micro_batch_tokens", type=int)
    parser.add_argument("settings", nargs="+")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    path = f"/tmp/probe-{args.shape}"
    nparams = build(args.shape, path)
    seqs = groups(32, 8, 128, 1024, 0)
    head = dict(
        shape=args.shape,
        params=nparams,
        seqs=len(seqs),
        tokens=sum(len(s.input_ids) for s in seqs),
        response_tokens=sum(s.num_response_tokens for s in seqs),
        overrides=args.overrides,
    )
    print(json.dumps(head), flush=True)
    for setting in args.settings:
        result = probe(setting, path, nparams, seqs, args.micro_batch_tokens, args.overrides)
        print(json.dumps(result), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
