"""Step time and its breakdown for max_staleness 0 and 1 on the same config.

    .venv/bin/python bench/step_time.py [--steps 6] [--set key=value ...]

Prints, per setting, the mean over steps after the first (which pays warm-up) of the step
time and of each stage, the tokens generated per second of step time, and the bound the
overlap aims for: max(generation + reward, learning) + sync.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import ray

from groupflow.config import build_config
from groupflow.driver import run

STAGES = ("time_gen_s", "time_reward_s", "time_learn_s", "time_sync_s", "time_step_s")


def measure(staleness: int, steps: int, overrides: list[str], out: Path) -> dict:
    cfg = build_config(
        {},
        [
            f"trainer.steps={steps}",
            f"trainer.max_staleness={staleness}",
            f"trainer.output_dir={out}",
            f"trainer.run_name=staleness{staleness}",
            "task.eval_size=16",
            "metrics.progress=false",
            *overrides,
        ],
    )
    run(cfg)
    records = [
        json.loads(x)
        for x in (out / f"staleness{staleness}" / "metrics.jsonl").read_text().splitlines()
    ]
    steady = records[1:] or records
    row = {k: statistics.fmean(r[k] for r in steady) for k in STAGES}
    row["tokens_per_s"] = statistics.fmean(r["tokens_generated"] / r["time_step_s"] for r in steady)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    ray.init(log_to_driver=False, include_dashboard=False, num_cpus=8)
    with tempfile.TemporaryDirectory() as tmp:
        rows = {s: measure(s, args.steps, args.overrides, Path(tmp)) for s in (0, 1)}
    ray.shutdown()
    print(f"\nstep time breakdown, mean of steps 2..{args.steps} (seconds)")
    print(
        f"{'staleness':>9} {'gen':>7} {'reward':>7} {'learn':>7} {'sync':>7} {'step':>7} {'tok/s':>8} {'bound':>7}"
    )
    for s, r in rows.items():
        bound = max(r["time_gen_s"] + r["time_reward_s"], r["time_learn_s"]) + r["time_sync_s"]
        print(
            f"{s:>9} {r['time_gen_s']:7.2f} {r['time_reward_s']:7.2f} {r['time_learn_s']:7.2f} "
            f"{r['time_sync_s']:7.2f} {r['time_step_s']:7.2f} {r['tokens_per_s']:8.0f} {bound:7.2f}"
        )
    print(f"speed-up of overlap: {rows[0]['time_step_s'] / rows[1]['time_step_s']:.2f}x")


if __name__ == "__main__":
    main()
