"""Where step records go: metrics.jsonl, and a progress line per step (also in driver.log).

The records' keys are described in groupflow/observe/catalogue.py.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from groupflow.config import Config
from groupflow.observe.driver_log import FILE_ONLY
from groupflow.observe.progress import clock_text


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


# The ETA's window: recent enough to follow a job that speeds up (a warmed cache) or slows down
# (longer responses), long enough to smooth over the steps that also evaluate or checkpoint.
RECENT_STEPS = 10


class ProgressReporter:
    """A progress bar on a terminal; one plain line per step otherwise (logs, CI, Ray jobs).
    Each step's line has the time since training began in this process and an ETA from the
    mean wall time of the last RECENT_STEPS steps (evaluations and checkpoints included), and
    goes to runs/<name>/driver.log either way."""

    def __init__(self, cfg: Config, clock: Callable[[], float] = time.monotonic):
        self.interactive = cfg.metrics.progress and sys.stderr.isatty()
        self.total = cfg.trainer.steps
        self.clock = clock
        self.started = self._last = clock()
        self._recent: deque[float] = deque(maxlen=RECENT_STEPS)
        self.bar = None  # made at the first step, where a resumed run's bar starts

    def __enter__(self) -> ProgressReporter:
        return self

    def line(self, record: dict) -> str:
        """The step's line; called once a step, as its record comes."""
        now = self.clock()
        self._recent.append(now - self._last)
        self._last = now
        left = sum(self._recent) / len(self._recent) * max(0, self.total - record["step"])
        return (
            f"step {record['step']}/{self.total} {self._figures(record)} "
            f"elapsed={clock_text(now - self.started)} eta={clock_text(left)}"
        )

    @staticmethod
    def _figures(record: dict) -> str:
        return (
            f"reward={record['reward_mean']:.3f} entropy={record['entropy_mean']:.3f} "
            f"tok/s={record['gen_tokens_per_s']:.0f} step={record['time_step_s']:.1f}s"
        )

    def write(self, record: dict) -> None:
        line = self.line(record)
        FILE_ONLY.info("%s", line)
        if not self.interactive:
            print(line, file=sys.stderr, flush=True)
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, initial=record["step"] - 1, desc="train", unit="step")
        self.bar.set_postfix_str(self._figures(record), refresh=False)
        self.bar.update(1)

    def __exit__(self, *_exc) -> None:
        if self.bar is not None:
            self.bar.close()
