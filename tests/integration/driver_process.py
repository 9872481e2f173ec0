"""A `groupflow train` driver in a process of its own on the shared Ray cluster, for tests
that kill it or talk to it (`groupflow scale`) while it trains."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import ray


def run_records(run: Path) -> list[dict]:
    """The complete lines of a run's metrics.jsonl so far."""
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


class DriverProcess:
    def __init__(self, train_args: list[str], output_dir: Path):
        self.log_path = output_dir / "driver.log"
        address = ray.get_runtime_context().gcs_address
        self.process = subprocess.Popen(
            [sys.executable, "-m", "groupflow.run.cli", "train", *train_args]
            + ["--set", f"trainer.output_dir={output_dir}", "--set", f"cluster.address={address}"],
            stdout=self.log_path.open("w"),
            stderr=subprocess.STDOUT,
        )
        self.pid = self.process.pid

    def wait_for(self, condition: Callable[[], bool], timeout_s: float = 300) -> None:
        """Until `condition()` holds; fails with the log's tail if the driver ends first or
        the time runs out."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert self.process.poll() is None, self.log()[-4000:]
            assert time.monotonic() < deadline, self.log()[-4000:]
            time.sleep(0.2)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def log(self) -> str:
        return self.log_path.read_text()
