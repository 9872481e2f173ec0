"""Learner time per step with the token-credit transforms and diagnostics on versus off.

    .venv/bin/python bench/credit_overhead.py [--steps 8]

Runs the quickstart model for a few steps with three settings on one Ray cluster and prints
the mean (over steps after the first) of the learner's step time plus the driver's
diagnostics time:
  baseline  plain GRPO, no cancellation diagnostic
  credit    STAPO + AR + 20-Entropy + dual clip, all diagnostics
  lopti     "credit" plus Lopti (its second optimizer update is reported separately)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import ray

from groupflow.run.driver import run
from groupflow.run.job_config import small_model_config

SETTINGS = {
    "baseline": ["algorithm.cancellation_diagnostic=false"],
    "credit": [
        "algorithm.stapo.enabled=true",
        "algorithm.ar.alpha=0.3",
        "algorithm.entropy_mask.enabled=true",
        "algorithm.clip.dual_clip=3.0",
    ],
}
SETTINGS["lopti"] = [*SETTINGS["credit"], "algorithm.lopti.enabled=true"]


def measure(name: str, steps: int, out: Path) -> dict:
    cfg = small_model_config(
        {},
        [
            f"trainer.steps={steps}",
            f"trainer.output_dir={out}",
            f"trainer.run_name={name}",
            "task.eval_size=16",
            "metrics.progress=false",
            "learner.optimizer.lr=1e-4",
            *SETTINGS[name],
        ],
    )
    run(cfg)
    lines = (out / name / "metrics.jsonl").read_text().splitlines()
    steady = [json.loads(x) for x in lines][1:]
    return {
        "learn": statistics.fmean(r["time_learn_s"] for r in steady),
        "metrics": statistics.fmean(r["time_metrics_s"] for r in steady),
        "updates": statistics.fmean(r["optimizer_updates"] for r in steady),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    ray.init(log_to_driver=False, include_dashboard=False, num_cpus=8)
    with tempfile.TemporaryDirectory() as tmp:
        rows = {name: measure(name, args.steps, Path(tmp)) for name in SETTINGS}
    ray.shutdown()
    base = rows["baseline"]["learn"] + rows["baseline"]["metrics"]
    print(f"\nlearner + diagnostics time per step, mean of steps 2..{args.steps} (seconds)")
    print(f"{'setting':>8} {'learn':>8} {'diag':>8} {'total':>8} {'updates':>8} {'overhead':>9}")
    for name, r in rows.items():
        total = r["learn"] + r["metrics"]
        print(
            f"{name:>8} {r['learn']:8.3f} {r['metrics']:8.3f} {total:8.3f} {r['updates']:8.1f} "
            f"{100 * (total / base - 1):8.1f}%"
        )
    # Lopti's second update is inherent to the method: report its cost per update too.
    per_update = (rows["lopti"]["learn"] + rows["lopti"]["metrics"]) / rows["lopti"]["updates"]
    print(
        f"lopti per optimizer update: {per_update:.3f}s ({100 * (per_update / base - 1):.1f}% vs baseline)"
    )


if __name__ == "__main__":
    main()
