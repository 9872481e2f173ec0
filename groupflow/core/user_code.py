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
        raise UserCodeError(
            f"{setting} {spec!r}: import failed: {type(err).__name__}: {short_text(err)}"
        ) from None
    if not hasattr(module, attribute):
        raise UserCodeError(f"{setting} {spec!r}: {target} has no {attribute!r}")
    return getattr(module, attribute)


def spec_file(spec: str) -> str | None:
    """The file that `path/to/file.py:name` loads from; None for `module:name`."""
    target, sep, _ = spec.rpartition(":")
    return target if sep and (target.endswith(".py") or "/" in target) else None


def short_text(value: object, limit: int = 200) -> str:
    """One line of str(value), bounded; an object whose str() raises (users' objects may) is
    named by its type."""
    try:
        text = " ".join(str(value).split())
    except BaseException:
        text = f"<{type(value).__name__} whose str() raised>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
