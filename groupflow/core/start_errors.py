"""An actor that fails while it starts, said in one line: its own error and its node.

Ray reports such a death as a paragraph: "The actor died because of an error raised in its
creation task, ray::Generator.__init__() (pid=..., ip=...)" followed by the actor's traceback.
The first line says only that it died; the cause (a model path missing on that node, an import
error) is the traceback's last line, and the node is the `ip=` Ray puts in the header.
"""

from __future__ import annotations

import re

from groupflow.core.errors import UserError

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# A traceback's closing line, "SomeError: message", at the start of a line.
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(: \S.*)?$")
_NODE = re.compile(r"\bip=([0-9A-Za-z.:\-\[\]]+)")


class StartError(UserError):
    """An actor of the job died while it started."""

    exit_code = 1


def own_error(text: str) -> str:
    """The actor's own error in Ray's report of its death: the last line of its traceback
    when the report has one, else the report's first line."""
    lines = [line.rstrip() for line in _ANSI.sub("", text).strip().splitlines() if line.strip()]
    if not lines:
        return "no error text"
    if any(line.lstrip().startswith('File "') for line in lines):
        for line in reversed(lines):
            if _EXCEPTION_LINE.match(line) and ":" in line:
                return line
    return lines[0]


def start_failure(what: str, text: str) -> str:
    """One line: which actor failed to start, on which node, and its own error."""
    node = _NODE.search(_ANSI.sub("", text))
    where = f" on node {node.group(1)}" if node else ""
    article = "an" if what[:1] in "aeiou" else "a"
    return f"{article} {what} failed to start{where}: {own_error(text)}"
