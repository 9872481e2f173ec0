"""The one loader of users' code (groupflow/core/user_code.py): `module:name` and `file.py:name`,
each failure one line naming the setting, for every setting that names code."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from groupflow.core.errors import UserError, expected_failure
from groupflow.core.user_code import UserCodeError, load_user_object, short_text, spec_file
from groupflow.reward_workers.plugins import load_plugin
from groupflow.rollout.agent import user_environment
from groupflow.rollout.toolbox import ToolBox
from groupflow.rollout.tools import make_tools

ROOT = Path(__file__).resolve().parents[2]


def test_loads_by_module_and_by_file(tmp_path):
    assert load_user_object("json:dumps", "agent.tools") is __import__("json").dumps
    file = tmp_path / "mine.py"
    file.write_text("from dataclasses import dataclass\n@dataclass\nclass Thing:\n    x: int = 1\n")
    thing = load_user_object(f"{file}:Thing", "agent.environment")
    assert thing().x == 1  # the module is registered: dataclasses finds it
    assert spec_file(f"{file}:Thing") == str(file) and spec_file("json:dumps") is None


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", "expected 'module:name'"),
        (":name", "expected 'module:name'"),
        ("/nowhere/mine.py:f", "no such file /nowhere/mine.py"),
        ("surely_not_a_module_xyz:f", "import failed: ModuleNotFoundError"),
        ("json:no_such_name", "json has no 'no_such_name'"),
    ],
)
def test_each_failure_is_one_line_naming_the_setting(spec, message):
    with pytest.raises(UserCodeError, match=message) as err:
        load_user_object(spec, "agent.environment")
    text = str(err.value)
    assert text.startswith(f"agent.environment {spec!r}: ") and "\n" not in text
    # bad input like any config error: the CLI prints the line and exits 2
    assert isinstance(err.value, UserError | ValueError)
    assert expected_failure(err.value) == (text, 2)


@pytest.mark.parametrize(
    "body", ["raise SystemExit(0)", "raise KeyboardInterrupt", "raise RuntimeError('a\\nb')"]
)
def test_whatever_a_module_does_at_import_is_a_load_error(tmp_path, body):
    file = tmp_path / "exits.py"
    file.write_text(body + "\n")
    with pytest.raises(UserCodeError, match="agent.tools .*import failed") as err:
        load_user_object(f"{file}:f", "agent.tools")
    assert "\n" not in str(err.value)
    assert not [m for m in sys.modules if m.startswith("groupflow_plugin_exits_")]


def test_every_setting_that_names_code_uses_it():
    """A reward plugin, a tool and an environment: the same errors, each naming its setting."""
    spec = "surely_not_a_module_xyz:f"
    loaders = [
        ("reward plugin", lambda: load_plugin(spec)),
        ("agent.tools", lambda: make_tools([spec], None, 1.0)),
        ("agent.environment", lambda: user_environment(spec, ToolBox([], 1.0, 10))),
    ]
    for setting, load in loaders:
        with pytest.raises(UserCodeError) as err:
            load()
        assert str(err.value) == (
            f"{setting} {spec!r}: import failed: ModuleNotFoundError: "
            "No module named 'surely_not_a_module_xyz'"
        )


def test_no_other_module_imports_users_code():
    """Only user_code.py imports modules by name or file (the task registry imports its own
    built-in task modules, which are no user's code)."""
    allowed = {
        "import_module": {"groupflow/core/user_code.py", "reward_workers/tasks/__init__.py"},
        "spec_from_file_location": {"groupflow/core/user_code.py"},
    }
    found: dict[str, set[str]] = {name: set() for name in allowed}
    files = {
        path.resolve()  # a link to a folder (a development layout) counts its files once
        for folder in ("groupflow", "actors", "rollout", "learner", "reward_workers")
        for path in (ROOT / folder).rglob("*.py")
    }
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in found:
                found[node.attr].add(str(path.relative_to(ROOT)))
    assert found == allowed


def test_short_text_is_one_bounded_line_even_for_hostile_objects():
    class Hostile:
        def __str__(self):
            raise RuntimeError("no")

    assert short_text("a\n  b\tc") == "a b c"
    assert short_text("x" * 500, limit=20) == "x" * 17 + "..."
    assert short_text(Hostile()) == "<Hostile whose str() raised>"
