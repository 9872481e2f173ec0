"""A run directory as `groupflow status` and `groupflow list` show it, read from its files alone
(no cluster): its state, the steps done of trainer.steps, the held-out accuracy before and
after, its model and checkpoints.

The state:
- running: its record (cluster.json, written while the driver lives) names a live driver, or a
  driver on another host (which cannot be checked from here);
- failed: the record names a driver on this host that has ended (it died without closing the
  run), or the run ended before its last step with no summary.json;
- stopped: summary.json marks the run stopped, or it ended before its last step;
- finished: summary.json, and every step of trainer.steps recorded.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from groupflow.loop.checkpoint import CONFIG_FILE, CheckpointStore
from groupflow.run.end import SUMMARY_FILE
from groupflow.run.live import CLUSTER_FILE, RunRecord, pid_alive, read_run_record

METRICS_FILE = "metrics.jsonl"
RUN_FILES = (CONFIG_FILE, METRICS_FILE, CLUSTER_FILE)
TAIL_BYTES = 1 << 20  # the end of metrics.jsonl read for its last step (a record is a few KiB)


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file() for name in RUN_FILES)


def _json_object(path: Path) -> dict:
    """The JSON object in `path`; {} when there is none (missing, partly written, not JSON)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def last_step(metrics: Path) -> int:
    """The step of the last whole record in metrics.jsonl; 0 with none."""
    try:
        with metrics.open("rb") as f:
            f.seek(max(0, f.seek(0, 2) - TAIL_BYTES))
            tail = f.read()
    except OSError:
        return 0
    for line in reversed(tail.splitlines()):
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue  # a record being written, or the cut first line of the tail
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            return record["step"]
    return 0


def _planned_steps(config: Path) -> int | None:
    """trainer.steps of the run's config.resolved.yaml."""
    try:
        steps = yaml.safe_load(config.read_text(encoding="utf-8"))["trainer"]["steps"]
    except (OSError, yaml.YAMLError, TypeError, KeyError, RecursionError):
        return None
    return steps if isinstance(steps, int) else None


def _accuracy(summary: dict) -> tuple[float, float] | None:
    before, after = summary.get("warm_start_accuracy"), summary.get("final_accuracy")
    if isinstance(before, int | float) and isinstance(after, int | float):
        return float(before), float(after)
    return None


def _live_record(run_dir: Path) -> tuple[RunRecord | None, bool]:
    """The run's record, and whether it names a driver still running (a LiveError naming the
    file when it is not a record)."""
    path = run_dir / CLUSTER_FILE
    if not path.is_file():
        return None, False
    record = read_run_record(path)
    here = record.host == socket.gethostname()
    return record, not here or pid_alive(record.pid)


@dataclass
class RunOnDisk:
    path: Path
    state: str  # running, finished, stopped or failed (the module's docstring)
    step: int  # the last step recorded
    steps: int | None  # trainer.steps
    accuracy: tuple[float, float] | None  # held-out, before -> after (summary.json)
    record: RunRecord | None = None  # cluster.json, while it is there
    checkpoints: list[Path] = field(default_factory=list)  # oldest first

    @property
    def name(self) -> str:
        return self.record.run if self.record is not None else self.path.name

    def progress(self) -> str:
        return f"{self.step}/{self.steps if self.steps is not None else '?'}"

    def accuracy_text(self) -> str:
        return "-" if self.accuracy is None else "{:.3f} -> {:.3f}".format(*self.accuracy)

    def lines(self) -> list[str]:
        """What `groupflow status` prints of it."""
        out = [
            f"run {self.name}  {self.state}  step {self.progress()}  "
            f"held-out accuracy {self.accuracy_text()}",
            f"directory: {self.path}",
        ]
        if self.state == "failed" and self.record is not None:
            out.append(f"its driver (pid {self.record.pid}) ended without closing the run")
        if (self.path / "model").is_dir():
            out.append(f"model: {self.path / 'model'}")
        if self.checkpoints:
            newest = self.checkpoints[-1]
            out.append(f"checkpoints: {len(self.checkpoints)}, newest {newest}")
            if self.state != "finished" and (self.path / CONFIG_FILE).is_file():
                out.append(f"resume: groupflow train {self.path / CONFIG_FILE} --resume")
        return out


def read_run(run_dir: Path) -> RunOnDisk:
    """The run in `run_dir` as its files tell it."""
    record, alive = _live_record(run_dir)
    summary = _json_object(run_dir / SUMMARY_FILE)
    step = last_step(run_dir / METRICS_FILE)
    steps = _planned_steps(run_dir / CONFIG_FILE)
    if record is not None:
        state = "running" if alive else "failed"
    elif summary.get("stopped") or summary.get("state") == "stopped":
        state = "stopped"
    elif summary and (steps is None or step >= steps):
        state = "finished"
    else:
        state = "stopped" if summary else "failed"
    checkpoints = CheckpointStore(run_dir).complete()
    return RunOnDisk(run_dir, state, step, steps, _accuracy(summary), record, checkpoints)


def runs_in(runs_dir: Path) -> list[RunOnDisk]:
    """Every run directory directly in `runs_dir`, the newest first; a run whose record is
    unreadable is left out (`groupflow status` of it says why)."""
    if not runs_dir.is_dir():
        return []
    found = []
    for path in runs_dir.iterdir():
        if path.name.startswith(".") or not is_run_dir(path):
            continue
        try:
            found.append((path.stat().st_mtime, read_run(path)))
        except (OSError, ValueError, RuntimeError):  # LiveError is a RuntimeError
            continue
    return [run for _, run in sorted(found, key=lambda pair: -pair[0])]
