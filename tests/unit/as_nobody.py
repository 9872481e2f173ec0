"""Run a script that imports a copy of the sandbox package as `nobody` with the system python:
a worker without root, as on the platforms docs/sandbox.md calls weak."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from groupflow.reward_workers import sandbox


def run_sandbox_as_nobody(body: str, timeout: float) -> dict:
    """Run `body` (after `import json, os, sys` and `from groupflow.reward_workers import
    sandbox`) as nobody; the JSON its last printed line holds. Skips where this process cannot
    become nobody."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to become nobody")
    copy = Path(tempfile.mkdtemp(prefix="gf-nonroot-"))  # pytest's tmp_path is root-only
    try:
        # The sandbox package alone (standard library only), under empty parent packages.
        parents = copy / "groupflow" / "reward_workers"
        shutil.copytree(
            Path(sandbox.__file__).parent,
            parents / "sandbox",
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        (copy / "groupflow" / "__init__.py").write_text("")
        (parents / "__init__.py").write_text("")
        script = copy / "run.py"
        script.write_text(
            f"import json, os, sys\nsys.path.insert(0, {str(copy)!r})\n"
            f"from groupflow.reward_workers import sandbox\n{body}"
        )
        for path in [copy, *copy.rglob("*")]:
            path.chmod(0o755)
        python = shutil.which("python3", path="/usr/bin:/usr/local/bin")
        out = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, str(script)],
            capture_output=True,
            text=True,
            cwd="/",
            timeout=timeout,
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.splitlines()[-1])
    finally:
        shutil.rmtree(copy)
