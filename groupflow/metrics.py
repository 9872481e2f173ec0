"""Where step records go: metrics.jsonl, and a progress line per step.

The records' keys are described in groupflow/catalogue.py.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from groupflow.config import Config


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

    def __exit__(self, *_exc) -> None:
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

    def write(self, record: dict) -> None:
        summary = (
            f"reward={record['reward_mean']:.3f} entropy={record['entropy_mean']:.3f} "
            f"tok/s={record['gen_tokens_per_s']:.0f} step={record['time_step_s']:.1f}s"
        )
        if self.interactive:
            self.bar.set_postfix_str(summary, refresh=False)
            self.bar.update(1)
        else:
            print(f"step {record['step']}/{self.total} {summary}", file=sys.stderr, flush=True)

    def __exit__(self, *_exc) -> None:
        self.bar.close()
