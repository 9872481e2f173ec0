"""One owner per state, read from the source: the job loop is the step loop only, nothing
sets the pipeline's state from outside, and the process wings reach the checkpoints' safe
unpickler without importing the driver's checkpoint store."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "groupflow" / "loop" / "job.py"
MAX_JOB_LINES = 200


def _imported(path: Path) -> set[str]:
    """Every module `path` imports, at any depth of its code."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_the_job_loop_is_the_step_loop_only():
    text = JOB.read_text()
    assert len(text.splitlines()) <= MAX_JOB_LINES
    # the checkpoints' layout, files and driver state are the checkpointer's
    for name in ("LEARNER_DIR", "HF_DIR", "staging", ".commit(", "DriverState("):
        assert name not in text, name


def test_nothing_sets_the_pipelines_state_from_outside():
    sets = re.compile(r"\bpipeline\.\w+\s*(\+|-)?=(?!=)")
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "groupflow").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if sets.search(line)
    ]
    assert found == []


def test_the_wings_reach_the_safe_unpickler_not_the_drivers_store():
    driver_side = {
        "groupflow.loop.checkpoint",
        "groupflow.loop.checkpointer",
        "groupflow.run.driver",
    }
    for wing in ("learner", "actors"):
        for path in sorted((ROOT / wing).glob("*.py")):
            assert not _imported(path) & driver_side, path
    assert "groupflow.core.safe_pickle" in _imported(ROOT / "learner" / "checkpoint.py")
    # the ground module itself stands on nothing of the project but its errors
    project = {
        m for m in _imported(ROOT / "groupflow" / "core" / "safe_pickle.py") if "groupflow" in m
    }
    assert project == {"groupflow.core.errors"}
