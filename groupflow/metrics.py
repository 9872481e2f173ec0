"""Per-step metrics: combined from the ranks, appended to metrics.jsonl, shown as progress."""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from pathlib import Path

import torch

from groupflow.config import Config
from groupflow.records import ScoredGroup, TrainSequence
from learner.diagnostics import cancellation_residual
from learner.trainer import StepResult


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def step_metrics(
    step: int,
    version: int,
    scored: list[ScoredGroup],
    seqs: list[TrainSequence],
    results: list[StepResult],
    staleness: list[int],
) -> dict:
    rewards = [r for g in scored for r in g.rewards]
    lengths = [len(resp.token_ids) for g in scored for resp in g.group.responses]
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for res in results:
        for key, value in res.sums.items():
            sums[key] = (
                max(sums.get(key, 0.0), value)
                if key.endswith("_max")
                else sums.get(key, 0.0) + value
            )
        for key, value in res.counts.items():
            counts[key] = counts.get(key, 0.0) + value
    # The planner's figures are already global over ranks: take rank 0's, averaged over mini-batches.
    plan_stats = results[0].plan_stats if results else []
    plan_mean = {
        k: statistics.fmean(p[k] for p in plan_stats) for k in (plan_stats[0] if plan_stats else {})
    }
    by_group: dict[int, list] = {}
    for res in results:
        for gid, ids, grads in res.token_grads:
            by_group.setdefault(gid, []).append((ids, torch.tensor(grads, dtype=torch.float64)))
    grad_norms = [g for res in results[:1] for g in res.grad_norms if not math.isnan(g)]
    record = {
        "step": step,
        "policy_version": version,
        "reward_mean": statistics.fmean(rewards) if rewards else 0.0,
        "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "accuracy": _ratio(sum(r >= 1.0 for r in rewards), len(rewards)),
        "response_len_mean": statistics.fmean(lengths) if lengths else 0.0,
        "tokens_generated": sum(lengths),
        "num_groups": len(scored),
        "num_sequences": len(seqs),
        "entropy_mean": _ratio(sums.get("entropy", 0.0), counts.get("tokens", 0.0)),
        "entropy_pos": _ratio(sums.get("entropy_pos", 0.0), counts.get("tokens_pos", 0.0)),
        "entropy_neg": _ratio(sums.get("entropy_neg", 0.0), counts.get("tokens_neg", 0.0)),
        "clip_frac_low": _ratio(sums.get("clip_low", 0.0), counts.get("update_tokens", 0.0)),
        "clip_frac_high": _ratio(sums.get("clip_high", 0.0), counts.get("update_tokens", 0.0)),
        "approx_kl": _ratio(sums.get("approx_kl", 0.0), counts.get("update_tokens", 0.0)),
        "kl_ref": _ratio(sums.get("kl_ref", 0.0), counts.get("update_tokens", 0.0)),
        "grad_norm": statistics.fmean(grad_norms) if grad_norms else 0.0,
        "optimizer_updates": results[0].optimizer_updates if results else 0,
        "logp_mismatch_mean": _ratio(sums.get("logp_mismatch", 0.0), counts.get("tokens", 0.0)),
        "logp_mismatch_max": sums.get("logp_mismatch_max", 0.0),
        "staleness_mean": statistics.fmean(staleness) if staleness else 0.0,
        "staleness_max": max(staleness, default=0),
        "cancellation_residual": cancellation_residual(list(by_group.values())),
        # only nodes every response of the group passes through: exactly 0 when the
        # aggregation is exchangeable and nothing clips or masks by sign
        "cancellation_residual_whole_group": cancellation_residual(
            list(by_group.values()), whole_group=True
        ),
    }
    record["clip_frac"] = record["clip_frac_low"] + record["clip_frac_high"]
    record.update(plan_mean)
    return record


class MetricsWriter:
    """Appends one JSON object per step and flushes it to disk at once, so that a crash
    later in the run loses nothing already written."""

    def __init__(self, path: Path):
        self.path = path
        self._file = None

    def __enter__(self) -> MetricsWriter:
        self._file = self.path.open("a")
        return self

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def __exit__(self, *exc) -> None:
        self._file.close()


class ProgressReporter:
    """A progress bar on a terminal; one plain line per step otherwise (logs, CI, Ray jobs)."""

    def __init__(self, cfg: Config):
        from tqdm import tqdm

        self.interactive = cfg.metrics.progress and sys.stderr.isatty()
        self.bar = tqdm(
            total=cfg.trainer.steps, desc="train", unit="step", disable=not self.interactive
        )
        self.total = cfg.trainer.steps

    def __enter__(self) -> ProgressReporter:
        return self

    def update(self, record: dict) -> None:
        summary = (
            f"reward={record['reward_mean']:.3f} entropy={record['entropy_mean']:.3f} "
            f"tok/s={record['gen_tokens_per_s']:.0f} step={record['time_step_s']:.1f}s"
        )
        if self.interactive:
            self.bar.set_postfix_str(summary, refresh=False)
            self.bar.update(1)
        else:
            print(f"step {record['step']}/{self.total} {summary}", file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        self.bar.close()
