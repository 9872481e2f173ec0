"""The sandbox package's shape (reward_workers/sandbox/): callers go through its face, which
states the threat model, and the package needs nothing but the standard library."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from groupflow.reward_workers import sandbox

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(sandbox.__file__).resolve().parent
NAME = "groupflow.reward_workers.sandbox"


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, function-level imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            # `from groupflow.reward_workers.sandbox import run` reaches a module too
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def _project_files() -> set[Path]:
    return {
        path.resolve()  # a link to a folder (a development layout) counts its files once
        for folder in ("groupflow", "actors", "rollout", "learner", "reward_workers", "bench")
        for path in (ROOT / folder).rglob("*.py")
    }


def test_callers_use_the_face_only():
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    behind = {f"{NAME}.{m}" for m in modules}
    reaching_in = {
        str(path.relative_to(ROOT)): sorted(_imports(path) & behind)
        for path in _project_files()
        if not path.is_relative_to(PACKAGE) and _imports(path) & behind
    }
    assert reaching_in == {}


def test_the_package_needs_only_the_standard_library():
    """It runs as a copy on the system Python (tests/unit/as_nobody.py), and child.py on
    whichever interpreter an unprivileged user can read."""
    for path in PACKAGE.glob("*.py"):
        for module in _imports(path):
            top = module.partition(".")[0]
            inside = module == NAME or module.startswith(NAME + ".")
            assert inside or top in sys.stdlib_module_names, (path.name, module)


def test_the_face_states_the_threat_model():
    doc = sandbox.__doc__
    assert "What is contained, and how" in doc and "What is not contained" in doc
    for module in PACKAGE.glob("*.py"):
        if module.name != "__init__.py":
            assert module.name in doc, module.name  # the face maps every module
