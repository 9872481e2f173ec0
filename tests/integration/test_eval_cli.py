"""`groupflow eval`: held-out greedy accuracy of a model directory, one engine in-process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def _eval(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "groupflow.cli", "eval", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_eval_prints_the_accuracy_of_a_model(quickstart_model):
    proc = _eval("--model", quickstart_model, "--set", "task.eval_size=64")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["prompts"] == 64 and result["task"] == "arithmetic"
    # the warm-started model answers some, not all, held-out problems
    assert 0.0 < result["accuracy"] < 1.0


def test_eval_of_a_missing_model_is_one_line(tmp_path):
    proc = _eval("--model", str(tmp_path / "absent"))
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "model.path" in line and "absent" in line
