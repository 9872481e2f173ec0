"""Checkpoint size, seconds per save and per load, for the quickstart model and larger
random-init Qwen2 shapes.

    .venv/bin/python bench/checkpoint.py [--shapes quickstart,512x8,1024x8] [--repeats 2]

For each model, starts `learner.num_ranks` = 2 DeepSpeed ZeRO-3 ranks on a local Ray cluster
of its own, trains one step on random sequences (so that AdamW's moments exist), then times
`--repeats` whole checkpoint saves as a job makes them (every rank writes its shards into a
staging directory, the driver commits it by rename) and one load into the running ranks.
Prints the checkpoint's size on disk and the seconds; the model's own size for comparison.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import ray
import torch
from weight_sync import random_model  # bench/weight_sync.py, beside this script

from groupflow.actors.learner import LearnerGroup
from groupflow.config import Config
from groupflow.core.records import TrainSequence
from groupflow.loop.checkpoint import LEARNER_DIR, CheckpointStore, Provenance
from groupflow.loop.checkpointer import DriverState, Parts
from groupflow.loop.prompt_stream import StreamState
from groupflow.run.job_config import build_config
from groupflow.run.quickstart import quickstart_model_path


def _sequences(vocab: int, n: int = 16) -> list[TrainSequence]:
    g = torch.Generator().manual_seed(0)
    return [
        TrainSequence(torch.randint(3, vocab, (48,), generator=g).tolist(), 8, 1.0, i, 0, [])
        for i in range(n)
    ]


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def bench(model_path: str, label: str, model_bytes: int, repeats: int, root: Path) -> None:
    cfg = build_config({}, ["learner.num_ranks=2"])
    vocab = json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]
    learner = LearnerGroup(cfg, model_path)
    try:
        ray.get(learner.async_train_step(_sequences(vocab)))
        store = CheckpointStore(root / label)
        saves, path = [], None
        for step in range(1, repeats + 1):
            started = time.perf_counter()
            staging = store.staging(step)
            ray.get(learner.async_save_checkpoint(str(staging / LEARNER_DIR)))
            parts = Parts(
                prompt_stream=StreamState(consumed=0), restarts={}, reward_totals={}, held_out={}
            )
            state = DriverState(
                step=step,
                policy_version=step,
                provenance=Provenance(model_config_json={}, num_ranks=2),
                parts=parts,
            )
            path = store.commit(staging, step, state, cfg.dump_yaml(), keep=1)
            saves.append(time.perf_counter() - started)
        started = time.perf_counter()
        learner.load_checkpoint(str(path / LEARNER_DIR))
        load_s = time.perf_counter() - started
    finally:
        learner.shutdown()
    size = _size(path)
    print(
        f"{label:>10}  model {model_bytes / 2**20:8.1f} MiB  checkpoint {size / 2**20:8.1f} MiB "
        f"({size / model_bytes:.1f}x)  save {statistics.median(saves):6.2f}s "
        f"(median of {repeats})  load {load_s:6.2f}s",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="quickstart,512x8,1024x8")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    ray.init(num_cpus=8, log_to_driver=False, include_dashboard=False)
    try:
        with tempfile.TemporaryDirectory(prefix="groupflow-ckpt-bench-") as tmp:
            root = Path(tmp)
            for shape in args.shapes.split(","):
                if shape == "quickstart":
                    cfg = Config()
                    path = str(
                        quickstart_model_path(
                            cfg.task.name, cfg.task.options, cfg.model.warm_start_steps, False
                        )
                    )
                    from transformers import AutoModelForCausalLM

                    model = AutoModelForCausalLM.from_pretrained(path)
                    size = sum(p.numel() * p.element_size() for p in model.parameters())
                else:
                    hidden, layers = (int(x) for x in shape.split("x"))
                    directory = root / f"model-{shape}"
                    directory.mkdir()
                    size, path = random_model(hidden, layers, directory), str(directory)
                bench(path, shape, size, args.repeats, root)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
