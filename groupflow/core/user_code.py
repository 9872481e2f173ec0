"""Users' code named in the config: `module:name` (an importable module) or
`path/to/file.py:name` (a file), for a reward plugin (`reward.verifier`), a tool
(`agent.tools`) or an environment (`agent.environment`). The one loader of all of them:
whatever goes wrong while loading is one line naming the setting (`UserCodeError`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from groupflow.core.errors import UserError


class UserCodeError(UserError, ValueError):
    """Users' code that cannot be loaded or is not what its setting needs: one line, naming
    the setting and the spec; bad input like any config error (exit status 2)."""


def load_user_object(spec: str, setting: str) -> Any:
    """The object `spec` names; UserCodeError naming `setting` if it cannot be loaded.
    Whatever the module raises or exits with at import is that error too."""
    target, sep, attribute = spec.rpartition(":")
    if not sep or not target or not attribute:
        raise UserCodeError(f"{setting} {spec!r}: expected 'module:name' or 'file.py:name'")
    from_file = spec_file(spec) is not None
    if from_file and not Path(target).is_file():
        raise UserCodeError(f"{setting} {spec!r}: no such file {target}")
    try:
        module = _load_file(Path(target)) if from_file else importlib.import_module(target)
    except BaseException as err:  # import-time errors and exits, whatever they are
        raise UserCodeError(f"{setting} {spec!r}: import failed: {raised_text(err)}") from None
    if not hasattr(module, attribute):
        raise UserCodeError(f"{setting} {spec!r}: {target} has no {attribute!r}")
    return getattr(module, attribute)


def spec_file(spec: str) -> str | None:
    """The file that `path/to/file.py:name` loads from; None for `module:name`."""
    target, sep, _ = spec.rpartition(":")
    return target if sep and (target.endswith(".py") or "/" in target) else None


def text_of(value: object) -> str:
    """str(value) as a plain str; an object whose str() raises (users' objects may, with
    anything, SystemExit included) is named by its type instead."""
    try:
        # str.__str__: a str subclass's own methods (users' too) never run on what we print
        return str.__str__(str(value))
    except BaseException:
        return f"<{type(value).__name__} whose str() raised>"


def short_text(value: object, limit: int = 200) -> str:
    """One line of text_of(value), bounded."""
    text = " ".join(text_of(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def raised_text(err: BaseException) -> str:
    """What users' code raised, as one bounded line: `Type: message`, or `Type` alone. The one
    description of it wherever users' code runs (a reward plugin, a tool, an environment)."""
    text = short_text(err)
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _load_file(file: Path) -> Any:
    # A module name unique to the file, registered so that code in it (dataclasses, for one)
    # can find its own module.
    digest = hashlib.sha256(str(file.resolve()).encode()).hexdigest()[:12]
    name = f"groupflow_plugin_{file.stem}_{digest}"
    module_spec = importlib.util.spec_from_file_location(name, file)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"cannot load {file} as Python")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
