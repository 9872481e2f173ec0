"""No code that runs a job is dead or called by the tests alone: vulture at 60% confidence over
the packages and the benchmarks (not the tests), with the names that are used where it cannot
see them listed in pyproject.toml's [tool.vulture]."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _scan(*paths: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vulture", *paths],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_dead_code_scan_finds_nothing():
    scan = _scan()
    assert scan.returncode == 0, scan.stdout + scan.stderr


def test_the_scan_reports_a_function_nothing_calls(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def helper_nothing_calls():\n    return 1\n")
    scan = _scan("groupflow", str(planted))
    assert scan.returncode == 3 and "helper_nothing_calls" in scan.stdout, scan.stdout
