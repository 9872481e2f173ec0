"""Does the quickstart still learn when the samples are k versions old? Trains the built-in
quickstart job once for each trainer.max_staleness k (with the off-policy correction that
k > 0 turns on) and prints the held-out greedy accuracy before and after, in points.

    .venv/bin/python bench/staleness_learning.py [--staleness 0 1 2 3 4] [--set key=value ...]

Each run also reports its mean step time and the lag its samples actually had (the engines
run at most k steps ahead; a learner faster than generation keeps the lag below k).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import ray

from groupflow.run.driver import run
from groupflow.run.job_config import load_config


def train_once(staleness: int, overrides: list[str], out: Path) -> dict:
    name = f"staleness{staleness}"
    cfg = load_config(  # the built-in quickstart job, as `groupflow train` runs it
        None,
        [
            f"trainer.max_staleness={staleness}",
            f"trainer.output_dir={out}",
            f"trainer.run_name={name}",
            "metrics.progress=false",
            *overrides,
        ],
    )
    summary = run(cfg)
    records = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
    return {
        "before": summary["warm_start_accuracy"],
        "after": summary["final_accuracy"],
        "step_s": statistics.fmean(r["time_step_s"] for r in records[1:] or records),
        "staleness_mean": statistics.fmean(r["staleness_mean"] for r in records),
        "dropped": sum(r["groups_dropped_stale"] for r in records),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    ray.init(log_to_driver=False, include_dashboard=False, num_cpus=8)
    with tempfile.TemporaryDirectory() as tmp:
        rows = {k: train_once(k, args.overrides, Path(tmp)) for k in args.staleness}
    ray.shutdown()
    print(
        f"\n{'staleness':>9} {'before':>6} {'after':>6} {'gain (points)':>13} "
        f"{'mean lag':>8} {'dropped':>7} {'s/step':>6}"
    )
    for k, r in rows.items():
        gain = 100 * (r["after"] - r["before"])
        print(
            f"{k:>9} {r['before']:6.3f} {r['after']:6.3f} {gain:13.1f} "
            f"{r['staleness_mean']:8.2f} {r['dropped']:7d} {r['step_s']:6.2f}"
        )


if __name__ == "__main__":
    main()
