"""`make test`: the unit tests and the integration tests as two pytest processes side by side.

A real-stack job leaves a core idle about a fifth of its time (starts, syncs, polling), and
the unit tests wait on their subprocesses (sandboxes, scorers, rank processes) for two fifths
of theirs: run one after the other on a 2-core machine they take half as long again as side by
side. The integration tests keep one Ray cluster between them (tests/conftest.py); the unit
tests start none. The integration tests' output streams as they run; the unit tests' is
printed whole when both are done, and the last lines sum up both runs with their failures.
Arguments are passed to both pytest runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _pytest(folder: str, durations: int, args: list[str]) -> list[str]:
    where = str(TESTS / folder)
    return [sys.executable, "-m", "pytest", "-q", f"--durations={durations}", *args, where]


def _outcome(lines: list[str]) -> list[str]:
    """pytest's last line (the counts and the time) and its FAILED/ERROR lines."""
    said = [line for line in lines if line.strip()]
    failures = [line for line in said if line.startswith(("FAILED ", "ERROR "))]
    return [said[-1] if said else "no output", *failures]


def main(args: list[str]) -> int:
    with tempfile.TemporaryFile("w+") as unit_output:
        unit_command = _pytest("unit", 10, args)
        unit = subprocess.Popen(unit_command, stdout=unit_output, stderr=subprocess.STDOUT)
        try:
            integration = subprocess.Popen(
                _pytest("integration", 15, args),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},  # its dots as each test ends
            )
            integration_lines = []
            for line in integration.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                integration_lines.append(line.rstrip("\n"))
            integration_code = integration.wait()
            unit_code = unit.wait()
        finally:
            if unit.poll() is None:  # interrupted: the unit tests stop with the integration tests
                unit.kill()
        unit_output.seek(0)
        unit_lines = unit_output.read().splitlines()
    print("\n" + " the unit tests (run beside the integration tests) ".center(79, "="))
    print("\n".join(unit_lines))
    print("=" * 79)
    for name, code, lines in (
        ("integration tests", integration_code, integration_lines),
        ("unit tests", unit_code, unit_lines),
    ):
        last, *failures = _outcome(lines)
        print(f"{name} (exit {code}): {last}", *failures, sep="\n  ")
    return integration_code or unit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
