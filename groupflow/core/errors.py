"""Expected failures: bad input or an unusable environment, each said in one line.

The command line (groupflow/run/cli.py: main) prints a `UserError` as `groupflow: error: ...` and
exits with its `exit_code`; a traceback is left for bugs."""

from __future__ import annotations

import argparse
import sys


class UserError(Exception):
    """A failure the user can act on, phrased as one line that names the culprit."""

    exit_code = 2  # bad input; problems of the cluster or the machine use 1


class UsageError(UserError):
    """A command line that argparse cannot read."""


class RunError(UserError, RuntimeError):
    """A problem with a training run's inputs or its run directory, reported as one line."""


class CheckpointError(ValueError):
    """A checkpoint that cannot resume this job, phrased as one line naming the file or key.
    Raised by the driver's checkpoint store and by the learner ranks alike."""


class OneLineParser(argparse.ArgumentParser):
    """An argument error is an expected failure like any other: one line, exit 2 (argparse
    itself would print the usage first)."""

    def error(self, message: str):
        raise UsageError(message)


def first_line(err: BaseException, limit: int | None = None) -> str:
    """The error's first line (its type's name when it has no text), cut to `limit`
    characters with "..." when given."""
    lines = str(err).strip().splitlines()
    text = lines[0] if lines else type(err).__name__
    if limit is not None and len(text) > limit:
        return text[: limit - 3] + "..."
    return text


def printable(text: str) -> str:
    """Text that can be written as UTF-8: lone surrogates (from JSON escapes such as
    "\\ud800") escaped."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def fail(message: str, code: int, prefix: str = "groupflow: error") -> int:
    """Print one error line (undecodable characters escaped) and return the exit code."""
    print(f"{prefix}: {printable(message)}", file=sys.stderr)
    return code


# Expected failures declared where this hierarchy cannot reach, found by name so that checking
# for them imports nothing: only a module already imported can have raised its error.
AUTH_HINT = (
    "the cluster requires a Ray auth token: set RAY_AUTH_MODE=token, with the token in "
    "RAY_AUTH_TOKEN or ~/.ray/auth_token"
)
_DECLARED_ELSEWHERE = (("ray.exceptions", "AuthenticationError", AUTH_HINT, 1),)


def _declared_elsewhere(err: Exception) -> tuple[str, int] | None:
    for module, name, message, code in _DECLARED_ELSEWHERE:
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(err, cls):
            return message or first_line(err), code
    return None


def expected_failure(err: Exception) -> tuple[str, int] | None:
    """(one line, exit code) for an expected failure; None for a bug. Bad input is a
    UserError or a ValueError (the project's input errors derive from it), exit 2; a machine
    or cluster that cannot be reached or read is an OSError, exit 1."""
    if isinstance(err, UserError):
        return first_line(err), err.exit_code
    found = _declared_elsewhere(err)
    if found is not None:
        return found
    if isinstance(err, ValueError):
        return first_line(err), 2
    if isinstance(err, OSError):
        return first_line(err), 1
    return None


def run_reporting_failures(command, *args, prefix: str = "groupflow: error") -> int:
    """Run a command; an expected failure becomes one line on stderr and its exit code."""
    try:
        return command(*args)
    except KeyboardInterrupt:
        return 130
    except Exception as err:
        failure = expected_failure(err)
        if failure is None:
            raise
        return fail(*failure, prefix=prefix)
