"""`make test`: the unit tests and the integration tests as two pytest processes side by side.

A real-stack job leaves a core idle about a fifth of its time (starts, syncs, polling), and
the unit tests wait on their subprocesses (sandboxes, scorers, rank processes) for two fifths
of theirs: run one after the other on a 2-core machine they take half as long again as side by
side. The integration tests keep one Ray cluster between them (tests/conftest.py); the unit
tests start none. The integration tests' output streams as they run; the unit tests' is
printed whole when both are done. Arguments are passed to both pytest runs.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _pytest(folder: str, durations: int, args: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        f"--durations={durations}",
        *args,
        str(TESTS / folder),
    ]


def main(args: list[str]) -> int:
    with tempfile.TemporaryFile("w+") as unit_output:
        unit = subprocess.Popen(
            _pytest("unit", 10, args), stdout=unit_output, stderr=subprocess.STDOUT
        )
        try:
            integration = subprocess.run(_pytest("integration", 15, args)).returncode
            unit_code = unit.wait()
        finally:
            if unit.poll() is None:  # interrupted: the unit tests stop with the integration tests
                unit.kill()
        unit_output.seek(0)
        print(
            "\n==================== the unit tests (run beside the integration tests) ===================="
        )
        print(unit_output.read(), end="", flush=True)
    print(f"integration tests: exit {integration}; unit tests: exit {unit_code}")
    return integration or unit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
