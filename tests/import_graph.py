"""groupflow's import graph, read from the source through pyproject's package-dir mapping.

Every import counts: module level, inside functions and under TYPE_CHECKING. A module is a
file (a package is its __init__). `python tests/import_graph.py` prints the figures quoted in
the README's module map: modules, arrows, loops, floors and the largest files.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _mapping(root: Path) -> dict[str, Path]:
    table = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: root / folder for name, folder in table["package-dir"].items()}


def source_files(root: Path = ROOT) -> dict[str, Path]:
    """Installed module name -> its file, for every module of the package."""
    mapping = _mapping(root)
    found: dict[str, Path] = {}
    for package, folder in mapping.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([package, *parts])
            # a folder mapped on its own is read under its own entry
            if any(
                other != package
                and name.startswith(other + ".")
                or name == other
                and other != package
                for other in mapping
                if other.startswith(package + ".")
            ):
                continue
            found[name] = path
    return found


@dataclass(frozen=True)
class Arrow:
    importer: str
    imported: str
    line: int


def _imported_names(tree: ast.AST, module: str, is_package: bool):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                yield f"{target}.{alias.name}", node.lineno
                yield target, node.lineno


def arrows(root: Path = ROOT) -> list[Arrow]:
    files = source_files(root)

    def owner(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    found = set()
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        for name, line in _imported_names(tree, module, path.name == "__init__.py"):
            if not name.startswith("groupflow"):
                continue
            target = owner(name)
            # `from pkg import sub` names the submodule; `from pkg import obj` names pkg
            if target and target != module and not (target == "groupflow" and name != "groupflow"):
                found.add(Arrow(module, target, line))
    # one arrow per pair, at its first line
    first: dict[tuple[str, str], Arrow] = {}
    for a in sorted(found, key=lambda a: a.line):
        first.setdefault((a.importer, a.imported), a)
    return sorted(first.values(), key=lambda a: (a.importer, a.imported))


def loops(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return groups


def floors(edges: dict[str, set[str]]) -> dict[str, int]:
    """Each module's floor: 1 + the highest floor it imports; an import loop is one floor."""
    group = {m: min(g) for g in loops(edges) for m in g}
    rep = {m: group.get(m, m) for m in edges}
    below: dict[str, set[str]] = {}
    for v, targets in edges.items():
        below.setdefault(rep[v], set()).update(rep[w] for w in targets if rep[w] != rep[v])
    floor: dict[str, int] = {}

    def of(v: str) -> int:
        if v not in floor:
            floor[v] = 1 + max((of(w) for w in below.get(v, ())), default=0)
        return floor[v]

    return {m: of(rep[m]) for m in edges}


def main() -> None:
    files = source_files()
    edges: dict[str, set[str]] = {m: set() for m in files}
    for a in arrows():
        edges[a.importer].add(a.imported)
    height = floors(edges)
    print(
        f"modules {len(files)}, arrows {sum(map(len, edges.values()))}, "
        f"loops {len(loops(edges))}, floors {max(height.values())}"
    )
    sizes = sorted(((len(p.read_text().splitlines()), m) for m, p in files.items()), reverse=True)
    print("largest: " + ", ".join(f"{m.removeprefix('groupflow.')} {n}" for n, m in sizes[:6]))


if __name__ == "__main__":
    main()
