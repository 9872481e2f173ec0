"""The package's folder list is written once, in pyproject.toml's package-dir; every other
list of it (pyproject's packages, --ship-code's SUBPACKAGES, deploy/Dockerfile's COPY lines,
checked in test_deploy.py) must agree with it."""

from __future__ import annotations

import tomllib
from pathlib import Path

from groupflow.run.jobs import SUBPACKAGES

ROOT = Path(__file__).resolve().parents[2]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
PACKAGE_DIR: dict[str, str] = SETUPTOOLS["package-dir"]


def packages_on_disk() -> set[str]:
    """Every folder with an __init__.py under a mapped folder, by its installed name."""
    found = set()
    for name, folder in PACKAGE_DIR.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *parts)))
    return found


def test_every_mapped_folder_is_installed_with_its_subpackages():
    assert set(SETUPTOOLS["packages"]) == packages_on_disk()
    assert {"groupflow.actors", "groupflow.reward_workers.tasks"} <= packages_on_disk()


def test_ship_code_stages_the_mapped_folders():
    mapped = {name.removeprefix("groupflow.") for name in PACKAGE_DIR if name != "groupflow"}
    assert set(SUBPACKAGES) == mapped
    assert all(PACKAGE_DIR[f"groupflow.{name}"] == name for name in SUBPACKAGES)
