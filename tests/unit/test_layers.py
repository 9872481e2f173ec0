"""The house's layers (docs/architecture.md): every import, read from the source through
pyproject's package-dir mapping (function-level and TYPE_CHECKING ones too), goes down or
sideways, never up; the three process wings never import each other; and nothing loops."""

from __future__ import annotations

from tests.import_graph import arrows, loops, source_files

# Lowest first. A module may import its own layer and the layers below it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("ground", ("groupflow", "groupflow.core", "groupflow.config")),
    ("observe", ("groupflow.observe",)),
    ("wings", ("groupflow.rollout", "groupflow.learner", "groupflow.reward_workers")),
    ("actors", ("groupflow.actors",)),
    ("loop", ("groupflow.loop",)),
    ("run", ("groupflow.run",)),
]
WINGS = LAYERS[2][1]


def _room(module: str) -> str:
    """The folder a module belongs to: its longest prefix named in LAYERS."""
    rooms = [r for _, names in LAYERS for r in names if module == r or module.startswith(r + ".")]
    return max(rooms, key=len)


def _floor(room: str) -> int:
    return next(i for i, (_, names) in enumerate(LAYERS) if room in names)


def test_every_module_has_a_layer():
    homeless = [m for m in source_files() if _room(m) == "groupflow" and m != "groupflow"]
    assert not homeless, f"flat modules outside the layers' folders: {homeless}"


def test_no_import_goes_up_or_across_the_wings():
    wrong = []
    for a in arrows():
        src, dst = _room(a.importer), _room(a.imported)
        if _floor(dst) > _floor(src):
            wrong.append(
                f"{a.importer}:{a.line} imports {a.imported} ({LAYERS[_floor(dst)][0]} above {LAYERS[_floor(src)][0]})"
            )
        elif src in WINGS and dst in WINGS and src != dst:
            wrong.append(f"{a.importer}:{a.line} imports {a.imported} (one wing into another)")
    assert not wrong, "\n".join(wrong)


def test_nothing_loops():
    edges: dict[str, set[str]] = {m: set() for m in source_files()}
    for a in arrows():
        edges[a.importer].add(a.imported)
    assert not loops(edges)


def test_the_graph_reader_sees_every_kind_of_import(tmp_path):
    """A function-level import and a TYPE_CHECKING one are arrows too (the check would be blind
    to exactly the imports that hide a loop otherwise)."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools.package-dir]\n"groupflow" = "pkg"\n')
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "low.py").write_text("X = 1\n")
    (tmp_path / "pkg" / "high.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from groupflow.low import X\n"
        "def f():\n    from groupflow import low\n    return low\n"
    )
    found = {(a.importer, a.imported) for a in arrows(tmp_path)}
    assert ("groupflow.high", "groupflow.low") in found
