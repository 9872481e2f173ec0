"""Expected failures: bad input or an unusable environment, each said in one line.

The command line (groupflow/cli.py: main) prints a `UserError` as `groupflow: error: ...` and
exits with its `exit_code`; a traceback is left for bugs."""

from __future__ import annotations

import sys


class UserError(Exception):
    """A failure the user can act on, phrased as one line that names the culprit."""

    exit_code = 2  # bad input; problems of the cluster or the machine use 1


def first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def fail(message: str, code: int, prog: str = "groupflow") -> int:
    """Print one error line (undecodable characters escaped) and return the exit code."""
    text = message.encode("utf-8", "backslashreplace").decode("utf-8")
    print(f"{prog}: error: {text}", file=sys.stderr)
    return code
