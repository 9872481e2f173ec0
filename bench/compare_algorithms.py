"""Train a task with every preset over several seeds, at each staleness, and compare.

    .venv/bin/python bench/compare_algorithms.py [--task long_addition] [--seeds 5]
        [--steps 40] [--staleness 0 2] [--presets grpo stapo ...] [--out DIR]

Each (staleness, preset, seed) is one `groupflow train` run in this process's Ray cluster;
its summary and step records are kept under --out, and a run already there with the same
settings is not run again, so a comparison cut short goes on where it stopped (one there with
other settings stops the comparison with one line). Prints, per staleness, the final held-out
greedy accuracy (mean and standard deviation over seeds), its difference from GRPO with a
paired t-test over seeds (seed s of a preset against seed s of GRPO: the same prompt stream
and engine seeds), the entropy at the start and the end, and the token-credit diagnostics
averaged over the run. Writes table.json and, per staleness, curves_k<k>.png (reward,
entropy, spurious_frac, lowprob_grad_share by step, mean over seeds).

Staleness k > 0 trains with the off-policy correction (truncated importance weights,
algorithm.off_policy's default there).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import mpmath
import ray

from groupflow.config.presets import PRESETS
from groupflow.run.driver import run
from groupflow.run.job_config import small_model_config

DIAGNOSTICS = [
    "spurious_frac",
    "stapo_silenced_frac",
    "lowprob_grad_share",
    "cancellation_residual",
    "cancellation_residual_whole_group",
]
CURVES = ["reward_mean", "entropy_mean", "spurious_frac", "lowprob_grad_share"]


def run_name(staleness: int, preset: str, seed: int) -> str:
    return f"k{staleness}-{preset}-seed{seed}"


def train_once(args: argparse.Namespace, staleness: int, preset: str, seed: int) -> dict:
    """One run's summary and step records, from --out when it already finished there with
    the same settings (one that ran with others stops the comparison: it would be compared as
    if it had not)."""
    name = run_name(staleness, preset, seed)
    kept = args.out / name / "result.json"
    overrides = [
        f"task.name={args.task}",
        f"task.eval_size={args.eval_size}",
        f"algorithm.preset={preset}",
        f"trainer.seed={seed}",
        f"trainer.steps={args.steps}",
        f"trainer.max_staleness={staleness}",
        f"trainer.output_dir={args.out}",
        f"trainer.run_name={name}",
        f"rollout.prompts_per_step={args.prompts_per_step}",
        f"rollout.sampling.max_tokens={args.max_tokens}",
        f"rollout.sampling.temperature={args.temperature}",
        f"rollout.sampling.seed={seed}",
        f"model.warm_start_steps={args.warm_start_steps}",
        f"learner.optimizer.lr={args.lr}",
        "metrics.progress=false",
        *args.set,
    ]
    if kept.is_file():
        result = json.loads(kept.read_text())
        if result.get("overrides") != overrides:
            raise SystemExit(
                f"{kept}: a run with other settings is there; give another --out, or the same "
                "settings as that run"
            )
        return result
    summary = run(small_model_config({}, overrides))
    records = [json.loads(x) for x in (args.out / name / "metrics.jsonl").read_text().splitlines()]
    result = {"overrides": overrides, "summary": summary, "records": records}
    kept.write_text(json.dumps(result))
    return result


def paired_t_test(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Mean of x - y and the two-sided p-value of Student's paired t-test (NaN for fewer than
    two pairs; 1 when every difference is 0, and 0 when they are equal but not 0)."""
    diffs = [x - y for x, y in zip(xs, ys, strict=True)]
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return mean, math.nan
    sd = statistics.stdev(diffs)
    if sd == 0:
        return mean, 1.0 if mean == 0 else 0.0
    df = len(diffs) - 1
    t = mean / (sd / math.sqrt(len(diffs)))
    # P(|T| >= |t|) for Student's t with df degrees of freedom, as a regularised beta function
    return mean, float(mpmath.betainc(df / 2, 0.5, 0, df / (df + t * t), regularized=True))


def summarise(runs: list[dict], baseline: list[dict] | None) -> dict:
    finals = [r["summary"]["final_accuracy"] for r in runs]
    row = {
        "seeds": len(runs),
        "warm_start_accuracy": statistics.fmean(r["summary"]["warm_start_accuracy"] for r in runs),
        "final_accuracy_mean": statistics.fmean(finals),
        "final_accuracy_sd": statistics.stdev(finals) if len(finals) > 1 else 0.0,
        "entropy_first": statistics.fmean(r["records"][0]["entropy_mean"] for r in runs),
        "entropy_last": statistics.fmean(r["records"][-1]["entropy_mean"] for r in runs),
    }
    for key in DIAGNOSTICS:
        values = [x[key] for r in runs for x in r["records"]]
        row[key] = statistics.fmean(values)
        row[f"{key}_steps_nonzero"] = sum(v > 0 for v in values) / len(values)
    if baseline is not None:
        base = [r["summary"]["final_accuracy"] for r in baseline]
        row["vs_grpo_diff"], row["vs_grpo_p"] = paired_t_test(finals, base)
    return row


def curves(runs: list[dict]) -> dict[str, list[float]]:
    steps = min(len(r["records"]) for r in runs)
    return {
        key: [statistics.fmean(r["records"][i][key] for r in runs) for i in range(steps)]
        for key in CURVES
    }


def plot(by_preset: dict[str, dict[str, list[float]]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for ax, key in zip(axes.flat, CURVES, strict=True):
        for preset, series in by_preset.items():
            ax.plot(range(1, len(series[key]) + 1), series[key], label=preset)
        ax.set_title(key)
        ax.set_xlabel("step")
    axes.flat[0].legend(ncol=2, fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(staleness: int, rows: dict[str, dict]) -> None:
    print(f"\nstaleness {staleness}")
    print(
        f"{'preset':>10} {'final acc':>9} {'± sd':>6} {'Δ grpo':>7} {'p':>6} "
        f"{'H first':>7} {'H last':>7} {'spurious':>9} {'lowp grad':>9} {'cancel':>7} "
        f"{'whole grp':>9}"
    )
    for preset, r in rows.items():
        diff = r.get("vs_grpo_diff", math.nan)
        p = r.get("vs_grpo_p", math.nan)
        print(
            f"{preset:>10} {r['final_accuracy_mean']:9.3f} {r['final_accuracy_sd']:6.3f} "
            f"{diff:7.3f} {p:6.3f} {r['entropy_first']:7.3f} {r['entropy_last']:7.3f} "
            f"{r['spurious_frac']:9.5f} {r['lowprob_grad_share']:9.4f} "
            f"{r['cancellation_residual']:7.4f} {r['cancellation_residual_whole_group']:9.2e}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", default="long_addition")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--presets", nargs="+", default=sorted(PRESETS))
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--eval-size", type=int, default=200)
    parser.add_argument("--warm-start-steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--set", action="append", default=[], help="a further --set of each run")
    parser.add_argument("--out", type=Path, default=Path("runs/compare_algorithms"))
    args = parser.parse_args()
    unknown = sorted(set(args.presets) - PRESETS.keys())
    if unknown:
        parser.error(f"--presets: unknown preset {unknown[0]!r}; choose from {sorted(PRESETS)}")
    # GRPO first: every other preset is tested against it, seed by seed
    presets = ["grpo", *(p for p in args.presets if p != "grpo")]
    args.out.mkdir(parents=True, exist_ok=True)
    ray.init(log_to_driver=False, include_dashboard=False, num_cpus=8)
    table: dict[str, dict[str, dict]] = {}
    for staleness in args.staleness:
        rows, series, baseline = {}, {}, None
        for preset in presets:
            runs = [train_once(args, staleness, preset, seed) for seed in range(args.seeds)]
            if preset == "grpo":
                baseline = runs
            rows[preset] = summarise(runs, None if preset == "grpo" else baseline)
            series[preset] = curves(runs)
            print(f"k={staleness} {preset}: {rows[preset]}", flush=True)
        if "grpo" not in args.presets:
            del rows["grpo"], series["grpo"]
        table[f"staleness_{staleness}"] = {"rows": rows, "curves": series}
        title = f"{args.task}, staleness {staleness}: mean over {args.seeds} seeds"
        plot(series, title, args.out / f"curves_k{staleness}.png")
        print_table(staleness, rows)
    ray.shutdown()
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    (args.out / "table.json").write_text(json.dumps({"settings": settings, **table}, indent=1))
    print(f"\ntable: {args.out / 'table.json'}; plots: {args.out}/curves_k*.png")


if __name__ == "__main__":
    main()
