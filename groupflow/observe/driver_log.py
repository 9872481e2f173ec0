"""runs/<name>/driver.log: what the driver says (its logging, Python's warnings and the step
lines) kept in the run directory, for the run that was not watched on a terminal.

`DriverLog` keeps the records from the start of the run, since the warm start and the vetting
of prompts come before the run directory exists, and writes them to the file once it does
(`open`); from then on each record is written as it comes. The file is opened for appending,
so a resumed run's log holds the earlier runs' lines too, each run's beginning with a line
naming the command. The driver's own loggers (`groupflow.*`) are kept at INFO while the log is
open, whatever the process's logging level, so the file holds the run's whole story. A run
that fails ends its log with the failure: the one line `groupflow` prints, or the traceback of
a bug.

`FILE_ONLY` takes the lines that a progress bar shows instead on a terminal: they go to the
file alone.
"""

from __future__ import annotations

import logging
import os
import shlex
import socket
import sys
import warnings
from pathlib import Path
from typing import TextIO

from groupflow.core.errors import expected_failure

FILE_ONLY = logging.getLogger("groupflow.run_log")  # no module's logger lies under it
FILE_ONLY.propagate = False
FILE_ONLY.setLevel(logging.INFO)

FILE_NAME = "driver.log"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
# Lines kept before the run directory exists (a warm start says a few dozen); beyond, dropped
# and counted.
HELD_LINES = 10_000


class _RunLogHandler(logging.Handler):
    """Formats every record it gets: holds the lines until a file is given, then writes them
    there, and every later line as it comes."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
        self.held: list[str] = []
        self.dropped = 0
        self.stream: TextIO | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + "\n"
            if self.stream is not None:
                self.stream.write(line)
                self.stream.flush()
            elif len(self.held) < HELD_LINES:
                self.held.append(line)
            else:
                self.dropped += 1
        except Exception:
            self.handleError(record)

    def write_to(self, stream: TextIO) -> None:
        with self.lock:
            stream.writelines(self.held)
            if self.dropped:
                stream.write(f"(and {self.dropped} more of the run's first lines, not kept)\n")
            stream.flush()
            self.held, self.stream = [], stream

    def detach(self) -> TextIO | None:
        with self.lock:
            stream, self.stream = self.stream, None
            return stream


class DriverLog:
    """A context for the whole run (see the module's docstring); `open` once the run
    directory exists."""

    def __init__(self):
        self._handler = _RunLogHandler()
        self._groupflow = logging.getLogger("groupflow")
        self._level = logging.NOTSET
        self._showwarning = warnings.showwarning
        self.path: Path | None = None

    def __enter__(self) -> DriverLog:
        logging.getLogger().addHandler(self._handler)
        FILE_ONLY.addHandler(self._handler)
        self._level = self._groupflow.level
        if self._groupflow.getEffectiveLevel() > logging.INFO:
            self._groupflow.setLevel(logging.INFO)
        self._showwarning = warnings.showwarning
        warnings.showwarning = self._show_warning
        command = shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv else ""
        FILE_ONLY.info(
            "driver started (pid %d on %s): %s", os.getpid(), socket.gethostname(), command
        )
        return self

    def _show_warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        """Python's warning, into the file as well as where it went before."""
        text = warnings.formatwarning(message, category, filename, lineno, line)
        FILE_ONLY.warning("%s", text.rstrip())
        self._showwarning(message, category, filename, lineno, file, line)

    def open(self, run_dir: Path) -> Path:
        """Append to run_dir/driver.log from now on, starting with the lines held so far."""
        self.path = run_dir / FILE_NAME
        self._handler.write_to(self.path.open("a", encoding="utf-8"))
        return self.path

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None:
            failure = expected_failure(exc) if isinstance(exc, Exception) else None
            if failure is not None:
                FILE_ONLY.error("groupflow: error: %s", failure[0])
            elif isinstance(exc, KeyboardInterrupt):
                FILE_ONLY.error("interrupted")
            else:
                FILE_ONLY.error("the run failed", exc_info=(exc_type, exc, tb))
        if warnings.showwarning == self._show_warning:  # not replaced since by another
            warnings.showwarning = self._showwarning
        self._groupflow.setLevel(self._level)
        FILE_ONLY.removeHandler(self._handler)
        logging.getLogger().removeHandler(self._handler)
        stream = self._handler.detach()
        if stream is not None:
            stream.close()
