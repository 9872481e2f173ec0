"""The run (driver, command line, `groupflow eval`, the dry run) stands on the job loop, and
nothing reaches back up: no import loop runs through the run's or the loop's modules, and no
module of the wings (rollout/, learner/, reward_workers/) or of actors/ imports either. Every
import is read, function-level and TYPE_CHECKING ones included, through pyproject's
package-dir mapping; nothing is imported."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The job loop and the run: what the wings and actors/ must never import.
LOOP_AND_RUN = {
    f"groupflow.{name}"
    for name in (
        "job",
        "pipeline",
        "held_out",
        "driver",
        "run_inputs",
        "job_prompts",
        "evaluate",
        "dry_run",
        "cli",
        "jobs",
        "live",
    )
}
WINGS_AND_ACTORS = tuple(
    f"groupflow.{p}." for p in ("rollout", "learner", "reward_workers", "actors")
)


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package by its import name, through [tool.setuptools.package-dir]."""
    with open(root / "pyproject.toml", "rb") as f:
        package_dir = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    modules = {}
    for package, folder in package_dir.items():
        for path in (root / folder).rglob("*.py"):
            parts = path.relative_to(root / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def imported(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `path` imports anywhere in it."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from groupflow import driver` imports a module; `from groupflow.x import y` a name
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
            names.add(node.module)
    found = set()
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            found.add(name)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = module_files(root)
    return {name: imported(path, modules) - {name} for name, path in modules.items()}


def loop_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A chain of imports from `start` back to it, if there is one."""
    seen, stack = set(), [[start]]
    while stack:
        chain = stack.pop()
        for nxt in sorted(graph.get(chain[-1], ())):
            if nxt == start:
                return [*chain, start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append([*chain, nxt])
    return None


def test_no_import_loop_runs_through_the_loop_or_the_run():
    graph = import_graph()
    loops = [loop_through(graph, name) for name in sorted(LOOP_AND_RUN) if name in graph]
    assert [chain for chain in loops if chain] == []


def test_the_wings_and_actors_import_nothing_of_the_loop_or_the_run():
    graph = import_graph()
    climbing = {
        name: sorted(imports & LOOP_AND_RUN)
        for name, imports in graph.items()
        if f"{name}.".startswith(WINGS_AND_ACTORS) and imports & LOOP_AND_RUN
    }
    assert climbing == {}


def test_the_tasks_prompt_pools_know_nothing_of_rendering():
    """Which prompts a model can take is groupflow/run/job_prompts.py's: the reward workers'
    prompt pools hand prompts out, and import nothing of the rollout wing."""
    graph = import_graph()
    crossing = {
        name: sorted(i for i in imports if i.startswith("groupflow.rollout"))
        for name, imports in graph.items()
        if name.startswith("groupflow.reward_workers")
    }
    assert {name: found for name, found in crossing.items() if found} == {}


def test_the_reader_sees_a_function_level_import(tmp_path):
    """A planted upward import inside a function, of the kind that made the loop
    driver -> job -> held_out -> evaluate -> driver, is found."""
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools.package-dir]\n"groupflow" = "groupflow"\n"groupflow.rollout" = "rollout"\n'
    )
    for folder in ("groupflow", "rollout"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "groupflow" / "driver.py").write_text("from groupflow.rollout.engine import x\n")
    (tmp_path / "rollout" / "engine.py").write_text("def f():\n    from groupflow import driver\n")
    graph = import_graph(tmp_path)
    assert graph["groupflow.rollout.engine"] == {"groupflow", "groupflow.run.driver"}
    assert loop_through(graph, "groupflow.run.driver") == [
        "groupflow.run.driver",
        "groupflow.rollout.engine",
        "groupflow.run.driver",
    ]
