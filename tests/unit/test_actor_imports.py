"""actors/ sits below the job loop: an actor module imports the ground (records, config,
the loop's contracts, the scaling control protocol...), the process wings and other actors,
never the loop or the run that drive it."""

from __future__ import annotations

import ast
from pathlib import Path

ACTORS = Path(__file__).resolve().parents[2] / "actors"

# The loop and the run (and the loop's autoscale policy, groupflow/loop/scaling.py).
ABOVE = {
    "groupflow.loop.job",
    "groupflow.loop.pipeline",
    "groupflow.loop.prompt_stream",
    "groupflow.loop.scaling",
    "groupflow.loop.held_out",
    "groupflow.loop.live_series",
    "groupflow.run.driver",
    "groupflow.run.cli",
    "groupflow.run.jobs",
    "groupflow.run.live",
    "groupflow.run.evaluate",
}


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, at any depth (function-level and TYPE_CHECKING too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_no_actor_imports_the_loop_or_the_run():
    climbing = {
        f"actors/{path.name}: {module}"
        for path in sorted(ACTORS.glob("*.py"))
        for module in _imports(path) & ABOVE
    }
    assert not climbing, sorted(climbing)
