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
from groupflow.learner.figures import learner_record
from groupflow.learner.rank import StepResult


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
        "staleness_mean": statistics.fmean(staleness) if staleness else 0.0,
        "staleness_max": max(staleness, default=0),
    }
    record.update(learner_record(results))
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
