"""A run's directory under `trainer.output_dir`: its name held while the run lives, and a fresh
directory for a new run that keeps the earlier run of the same name."""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import time
from pathlib import Path

from groupflow.core.errors import RunError
from groupflow.run.live import CLUSTER_FILE, LiveError, pid_alive, read_run_record

log = logging.getLogger(__name__)


def claim_run_name(output_dir: Path, run_name: str) -> int:
    """Hold `run_name` under `output_dir` for as long as this process lives: an flock on a
    lock file beside the run directory (not in it, so that it survives the directory's
    renaming), which the kernel drops when the holder dies however it dies. Another live job
    of the same name holds it: this one is refused rather than move the live run's directory
    from under it. Returns the lock's file descriptor; closing it lets the name go."""
    if output_dir.exists() and not output_dir.is_dir():
        raise RunError(f"trainer.output_dir: {output_dir} is not a directory")
    lock_file = output_dir / f".{run_name}.lock"
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise RunError(
            f"trainer.output_dir: {err.filename or output_dir}: {err.strerror}"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise RunError(
            f"trainer.run_name: {output_dir / run_name} belongs to a run still training "
            f"({holder}); choose another run_name or let that run end"
        ) from None
    try:
        _refuse_a_live_record(output_dir / run_name)
    except RunError:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    return fd


def _refuse_a_live_record(run_dir: Path) -> None:
    """The lock is not all a live run holds: a lock file removed, or a run on another host
    (whose flock this host does not see), leaves the name free while the run's driver, named
    in its cluster.json, still writes there. A record naming a driver alive on this host, or
    any driver on another host, refuses the name."""
    try:
        record = read_run_record(run_dir / CLUSTER_FILE)
    except LiveError:  # none, or not a record: nothing names a driver
        return
    here = record.host == socket.gethostname()
    if here and (record.pid == os.getpid() or not pid_alive(record.pid)):
        return
    where = f"pid {record.pid} on {record.host}"
    fix = "" if here else f"; if that driver has ended, remove {run_dir / CLUSTER_FILE}"
    raise RunError(
        f"trainer.run_name: {run_dir} belongs to a run still training ({where}, named in its "
        f"{CLUSTER_FILE}); choose another run_name or let that run end{fix}"
    )


def fresh_run_dir(run_dir: Path) -> Path:
    """An empty run directory; an earlier run of the same name is kept, renamed by its time."""
    if run_dir.exists() and any(run_dir.iterdir()):
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(run_dir.stat().st_mtime))
        kept = run_dir.with_name(f"{run_dir.name}.{stamp}")
        n = 1
        while kept.exists() or kept.is_symlink():  # two runs kept in the same second
            n += 1
            kept = run_dir.with_name(f"{run_dir.name}.{stamp}.{n}")
        run_dir.rename(kept)
        log.info("kept the earlier run %s as %s", run_dir, kept)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir
