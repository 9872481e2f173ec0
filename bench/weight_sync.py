"""Weight sync time and effective bandwidth, both transports, random-init Qwen2 shapes.

    .venv/bin/python bench/weight_sync.py [--shapes 256x4,512x8,1024x8,1024x16] [--repeats 3]
                                          [--engines 1] [--bucket-mb 64] [--lora 8,32,128]

For each shape (hidden size x layers, intermediate = 2 x hidden, the quickstart's tokenizer),
starts the real stack on a local Ray cluster of its own: `learner.num_ranks` = 2 DeepSpeed
ZeRO-3 ranks and `--engines` vLLM engines, then times `--repeats` syncs per transport after one
warm-up sync. Prints seconds per sync and the effective bandwidth: model bytes (as the learner
holds them) / seconds, so an engine count above 1 does not inflate it, and the learner's
side alone: until every rank's partitions are in the object store (object store) or rank 0
has gathered and sent every bucket (collective); the engines load meanwhile and after. For the
object store, also the engines' side alone: their load of a sync already in the object store,
with the learner idle (on CPU, vLLM's own reload sets it). Costs about a minute of start-up per
shape. Every engine's load is checked against the learner's checksums, as in a job. With
`--lora`, each rank also starts a LoRA learner and engine on the same model and times the
object-store sync of its adapter alone (its bytes as the transport counts them), and how many
times faster it is than the full model's.

    .venv/bin/python bench/weight_sync.py --checksums

prints instead what the checksums cost alone (groupflow/core/weight_format.py): GB/s of a
bucket-sized tensor per dtype on one thread, a whole tensor and a partition that starts
off a word boundary.

    .venv/bin/python bench/weight_sync.py --tp-load [--shapes 512x8,1024x8] [--repeats 3]

prints instead, for each shape, a tensor-parallel engine's load (rollout.tensor_parallel_size
2, vLLM's multiprocess workers on this machine, no Ray) of its own weights, two ways: `whole`,
every worker handed every whole tensor in one message (the load before loads by shard), and
`by shard` (rollout/shard_stream.py), each worker reading its own part of each tensor alone.
For each, the most resident memory any worker held above its start while loading (sampled
every millisecond from outside the workers), against the model's bytes and a worker's shard
of them, and the seconds per load.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import ray
import torch

from groupflow.actors.generator import start_generator_pool
from groupflow.actors.learner import LearnerGroup
from groupflow.actors.transport_object_store import load_streamed, push_partitions
from groupflow.actors.transport_registry import make_transport
from groupflow.config import Config
from groupflow.core.random_model import random_causal_lm
from groupflow.core.weight_format import bucket_manifest, checksum
from groupflow.rollout.engine import EngineSettings, RolloutEngine
from groupflow.rollout.shard_stream import ResidentPeak
from groupflow.run.job_config import small_model_config
from groupflow.run.quickstart import quickstart_model_path

TRANSPORTS = ("object_store", "collective")


def random_model(hidden: int, layers: int, directory: Path) -> int:
    """A random-init Qwen2 in `directory` with the quickstart's tokenizer; its size in bytes."""
    from transformers import AutoConfig

    cfg = Config()
    tokenizer_from = quickstart_model_path(
        cfg.task.name, cfg.task.options, cfg.model.warm_start_steps, progress=False
    )
    model = random_causal_lm(
        AutoConfig.from_pretrained(tokenizer_from).vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(Path(tokenizer_from) / name, directory / name)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def time_syncs(
    kind: str, learner, engines, repeats: int, bucket_mb: int
) -> list[tuple[float, float]]:
    """(seconds until the learner's side is done, seconds until every engine has loaded)."""
    transport = make_transport(kind, learner, engines, bucket_mb)
    # warm-up: opens the weight group, first allocations
    ray.get(transport.async_sync(1, transport.engines).handles())
    seconds = []
    for version in range(2, repeats + 2):
        start = time.perf_counter()
        handles = transport.async_sync(version, transport.engines)
        ray.get(handles.learner)
        learner_done = time.perf_counter() - start
        for handle, loaded in zip(handles.engines, ray.get(handles.engines), strict=True):
            transport.check_load(handle, loaded)
        seconds.append((learner_done, time.perf_counter() - start))
    return seconds


def time_engines_alone(learner, engines, bucket_bytes: int, version: int) -> float:
    """Object store: seconds for the engines to load a sync whose partitions are all in the
    object store already, the learner idle: the engines' side alone, what the end-to-end
    figure cannot beat however fast the learner's side is."""
    manifest = ray.get(learner.ranks[0].weight_manifest.remote())
    buckets = bucket_manifest(manifest, bucket_bytes)
    sync = f"engines-alone-{version}"
    pushes = push_partitions(learner.ranks, buckets, sync, engines)
    ray.get(pushes)  # every partition in the object store and on its way to the engines
    start = time.perf_counter()
    ray.get([e.weight_sync.remote(load_streamed, buckets, version, sync, pushes) for e in engines])
    return time.perf_counter() - start


def bench_shape(
    hidden: int, layers: int, engines: int, repeats: int, bucket_mb: int, lora_ranks: list[int]
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        nbytes = random_model(hidden, layers, Path(tmp))
        full = bench_full(tmp, nbytes, f"{hidden}x{layers:<3}", engines, repeats, bucket_mb)
        for rank in lora_ranks:
            bench_lora(tmp, rank, f"{hidden}x{layers:<3}", engines, repeats, bucket_mb, full)


def _stack(model_dir: str, engines: int, lora_rank: int | None = None):
    overrides = [f"rollout.num_engines={engines}", "learner.num_ranks=2", "rollout.kv_cache_gib=1"]
    if lora_rank is not None:
        overrides += [f"learner.lora.rank={lora_rank}", f"learner.lora.alpha={2 * lora_rank}"]
    cfg = small_model_config({}, overrides)
    return start_generator_pool(cfg, model_dir), LearnerGroup(cfg, model_dir)


def bench_lora(
    model_dir: str, rank: int, shape: str, engines: int, repeats: int, bucket_mb: int, full: float
) -> None:
    """Object-store syncs of a rank-`rank` adapter on all linear layers (learner.lora)."""
    pool, learner = _stack(model_dir, engines, rank)
    try:
        times = time_syncs("object_store", learner, pool.engines, repeats, bucket_mb)
        nbytes = make_transport("object_store", learner, pool.engines, bucket_mb).bytes_per_sync
        seconds = statistics.median(t[1] for t in times)
        learner_s = statistics.median(t[0] for t in times)
        print(
            f"{shape} {nbytes / 1e6:9.2f} MB  lora r={rank:<5d} {seconds:8.3f} s/sync  "
            f"{full / seconds:6.1f}x faster than the full sync  {learner_s:8.3f} s",
            flush=True,
        )
    finally:
        learner.shutdown()
        pool.shutdown()


def bench_full(
    model_dir: str, nbytes: int, shape: str, engines: int, repeats: int, bucket_mb: int
) -> float:
    """Both transports on the whole model; the object store's median seconds per sync."""
    pool, learner = _stack(model_dir, engines)
    object_store_s = 0.0
    try:
        for kind in TRANSPORTS:
            times = time_syncs(kind, learner, pool.engines, repeats, bucket_mb)
            learner_s = statistics.median(t[0] for t in times)
            seconds = statistics.median(t[1] for t in times)
            alone = "        -"
            if kind == "object_store":
                object_store_s = seconds
                alone_s = statistics.median(
                    time_engines_alone(learner, pool.engines, bucket_mb * 2**20, 100 + i)
                    for i in range(repeats)
                )
                alone = f"{alone_s:8.3f} s"
            print(
                f"{shape} {nbytes / 1e6:9.1f} MB  {kind:12s} "
                f"{seconds:8.3f} s/sync  {nbytes / seconds / 1e9:6.2f} GB/s  "
                f"{learner_s:8.3f} s  {alone}",
                flush=True,
            )
    finally:
        learner.shutdown()
        pool.shutdown()
    return object_store_s


def bench_checksums(bucket_mb: int, repeats: int) -> None:
    print("dtype      MiB   whole tensor      partition off a word boundary", flush=True)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        numel = bucket_mb * 2**20 // torch.empty((), dtype=dtype).element_size()
        tensor = torch.randn(numel + 1).to(dtype)
        figures = []
        for part, start in ((tensor[:numel], 0), (tensor[1:], 1)):
            checksum(part, start)  # warm-up
            began = time.perf_counter()
            for _ in range(repeats):
                checksum(part, start)
            seconds = (time.perf_counter() - began) / repeats
            figures.append(f"{seconds:6.3f} s {bucket_mb * 2**20 / seconds / 1e9:5.2f} GB/s")
        print(f"{str(dtype).removeprefix('torch.'):9s} {bucket_mb:4d}   {'   '.join(figures)}")


def _descendants(pid: int) -> tuple[int, ...]:
    """The processes `pid` started, and theirs (Linux)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return tuple(c for child in children for c in (child, *_descendants(child)))


def bench_tp_load(hidden: int, layers: int, repeats: int) -> None:
    """A TP=2 engine's load of its own weights, whole and by shard (module doc)."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        nbytes = random_model(hidden, layers, Path(tmp))
        weights = {
            n: t for f in sorted(Path(tmp).glob("*.safetensors")) for n, t in load_file(f).items()
        }
        engine = RolloutEngine(EngineSettings(model_path=tmp, tensor_parallel_size=2))
        workers = _descendants(os.getpid())
        ways = {
            "whole": lambda: engine.llm.collective_rpc(
                "load_named_tensors", args=(list(weights.items()),)
            ),
            "by shard": lambda: engine.load_weights(iter(weights.items()), version=1),
        }
        for way, load in ways.items():
            load()  # warm-up: the allocator's first pages
            peaks, seconds = [], []
            for _ in range(repeats):
                with ResidentPeak(workers) as held:
                    began = time.perf_counter()
                    loaded = load()
                    seconds.append(time.perf_counter() - began)
                peaks.append(held.extra)
            shard = None
            if way == "by shard":  # and what the workers measured of themselves
                shard = max(w.received_bytes for w in loaded.workers)
                own = max(w.peak_extra_bytes for w in loaded.workers)
                print(f"  by shard: the workers' own peak +{own / 1e6:.1f} MB", flush=True)
            print(
                f"{hidden}x{layers:<3} {nbytes / 1e6:9.1f} MB  {way:9s} "
                f"worker peak +{max(peaks) / 1e6:8.1f} MB = {max(peaks) / nbytes:5.2f} x model"
                + (
                    f" = {max(peaks) / shard:5.2f} x its shard ({shard / 1e6:.1f} MB)"
                    if shard
                    else ""
                )
                + f"  {statistics.median(seconds):7.3f} s/load",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="256x4,512x8,1024x8,1024x16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--bucket-mb", type=int, default=64, help="rollout.weight_bucket_mb")
    parser.add_argument("--checksums", action="store_true", help="the checksums' cost alone")
    parser.add_argument(
        "--tp-load", action="store_true", help="a TP=2 engine's load, whole and by shard"
    )
    parser.add_argument(
        "--lora",
        default="",
        help="LoRA ranks to time too (e.g. 8,32,128): adapters on every linear layer, synced "
        "alone (learner.lora), beside the full model's object-store sync",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.checksums:
        bench_checksums(args.bucket_mb, args.repeats)
        return
    if args.tp_load:
        for shape in args.shapes.split(","):
            bench_tp_load(*(int(x) for x in shape.split("x")), args.repeats)
        return
    ray.init(num_cpus=8, log_to_driver=False, include_dashboard=False)
    print(
        "shape      model bytes  transport    median time       effective  learner side"
        "  engines alone",
        flush=True,
    )
    try:
        for shape in args.shapes.split(","):
            hidden, layers = (int(x) for x in shape.split("x"))
            lora = [int(r) for r in args.lora.split(",") if r]
            bench_shape(hidden, layers, args.engines, args.repeats, args.bucket_mb, lora)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
