"""Train the quickstart task with every preset over several seeds and compare.

    .venv/bin/python bench/compare_algorithms.py [--seeds 3] [--steps 30] [--out bench_out]

Prints a table of final held-out greedy accuracy (mean and spread over seeds), final entropy,
and the mean spurious_frac and cancellation_residual over training, and saves a PNG of the
reward curves (mean over seeds) per preset.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import ray

from groupflow.config import build_config
from groupflow.driver import run
from groupflow.presets import PRESETS


def train_once(preset: str, seed: int, steps: int, out: Path) -> tuple[dict, list[dict]]:
    name = f"{preset}-seed{seed}"
    cfg = build_config(
        {},
        [
            f"algorithm.preset={preset}",
            f"trainer.seed={seed}",
            f"trainer.steps={steps}",
            f"trainer.output_dir={out}",
            f"trainer.run_name={name}",
            "learner.optimizer.lr=1e-4",
            "task.eval_size=400",
            "metrics.progress=false",
        ],
    )
    summary = run(cfg)
    records = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
    return summary, records


def plot(curves: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for preset, rewards in curves.items():
        ax.plot(range(1, len(rewards) + 1), rewards, label=preset)
    ax.set_xlabel("step")
    ax.set_ylabel("train reward (mean over seeds)")
    ax.set_title("quickstart arithmetic: reward by preset")
    ax.legend(ncol=2, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("runs/compare_algorithms"))
    parser.add_argument("--presets", nargs="*", default=sorted(PRESETS))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ray.init(log_to_driver=False, include_dashboard=False, num_cpus=8)
    rows, curves = {}, {}
    for preset in args.presets:
        runs = [train_once(preset, seed, args.steps, args.out) for seed in range(args.seeds)]
        finals = [s["final_accuracy"] for s, _ in runs]
        rows[preset] = {
            "warm": statistics.fmean(s["warm_start_accuracy"] for s, _ in runs),
            "acc": statistics.fmean(finals),
            "spread": statistics.pstdev(finals),
            "entropy": statistics.fmean(r[-1]["entropy_mean"] for _, r in runs),
            "spurious": statistics.fmean(x["spurious_frac"] for _, r in runs for x in r),
            "residual": statistics.fmean(x["cancellation_residual"] for _, r in runs for x in r),
        }
        curves[preset] = [
            statistics.fmean(r[i]["reward_mean"] for _, r in runs) for i in range(args.steps)
        ]
        print(f"{preset}: {rows[preset]}", flush=True)
    ray.shutdown()
    print(
        f"\n{args.seeds} seeds x {args.steps} steps; accuracy = held-out greedy (start {rows[args.presets[0]]['warm']:.3f})"
    )
    print(
        f"{'preset':>10} {'final acc':>10} {'± sd':>6} {'entropy':>8} {'spurious':>9} {'cancel res':>10}"
    )
    for preset, r in rows.items():
        print(
            f"{preset:>10} {r['acc']:10.3f} {r['spread']:6.3f} {r['entropy']:8.3f} "
            f"{r['spurious']:9.5f} {r['residual']:10.3f}"
        )
    plot(curves, args.out / "reward_curves.png")
    (args.out / "table.json").write_text(json.dumps(rows, indent=1))
    print(f"plot: {args.out / 'reward_curves.png'}")


if __name__ == "__main__":
    main()
