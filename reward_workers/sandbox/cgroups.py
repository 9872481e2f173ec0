"""A memory cgroup per run: every page the program touches (memfd, tmpfs, shared memory
included, which RLIMIT_AS does not see) is charged to one cap, and every process in it is
killed at the end, wherever it went. v1 and v2 hierarchies alike; where the host delegates no
cgroup to us, the platform has none and says so (`SandboxPlatform.missing`)."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

_RUN_PREFIX = "gf-sandbox-"


def find_memory_cgroup() -> tuple[str | None, bool]:
    """(a cgroup directory of ours where we may create children with a memory limit, whether
    it is cgroup v2), or (None, False)."""
    try:
        with open("/proc/self/cgroup") as f:
            entries = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None, False
    for _, controllers, path in entries:
        if "memory" in controllers.split(","):
            base = f"/sys/fs/cgroup/memory{path}"
            if _can_create_child(base, "memory.limit_in_bytes"):
                return base, False
    for hierarchy, _, path in entries:
        if hierarchy == "0":
            for mount in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup"):
                base = f"{mount}{path}".rstrip("/")
                try:
                    with open(f"{base}/cgroup.subtree_control") as f:
                        enabled = "memory" in f.read().split()
                except OSError:
                    continue
                if enabled and _can_create_child(base, "memory.max"):
                    return base, True
    return None, False


def _can_create_child(base: str, limit_file: str) -> bool:
    probe = f"{base}/gf-probe-{os.getpid()}-{random.getrandbits(32):x}"
    try:
        os.mkdir(probe)
    except OSError:
        return False
    try:
        return os.path.exists(f"{probe}/{limit_file}")
    finally:
        os.rmdir(probe)


def make_cgroup(base: str, v2: bool, cap_bytes: int) -> str:
    """A fresh cgroup under `base` whose processes may use `cap_bytes` of memory, no swap."""
    _remove_orphaned_cgroups(base)
    path = f"{base}/{_RUN_PREFIX}{os.getpid()}-{random.getrandbits(48):x}"
    os.mkdir(path)
    settings = (
        {"memory.max": cap_bytes, "memory.swap.max": 0}
        if v2
        else {"memory.limit_in_bytes": cap_bytes, "memory.memsw.limit_in_bytes": cap_bytes}
    )
    for name, value in settings.items():
        try:
            Path(path, name).write_text(str(value))
        except OSError:
            if "swap" not in name and "memsw" not in name:  # swap accounting may be off
                os.rmdir(path)
                raise
    return path


def join_cgroup(path: str) -> None:
    """Move the calling process into the cgroup. Raw system calls only: this runs in the
    child between fork and exec (run.py's preexec)."""
    fd = os.open(f"{path}/cgroup.procs", os.O_WRONLY)
    try:
        os.write(fd, str(os.getpid()).encode())
    finally:
        os.close(fd)


def _remove_orphaned_cgroups(base: str) -> None:
    """Cgroups of scorers that were killed mid-run (their sandboxes died with them, by the
    parent-death signal; the empty directories stay until someone removes them)."""
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if name.startswith(_RUN_PREFIX) and len(parts) == 4 and parts[2].isdigit():
            if not os.path.exists(f"/proc/{parts[2]}"):
                kill_cgroup(f"{base}/{name}")
                remove_cgroup(f"{base}/{name}")


def kill_cgroup(path: str) -> None:
    """SIGKILL every process in the cgroup, again while any is left (one may fork as it
    dies), for half a second at most."""
    for _ in range(50):
        try:
            pids = [int(p) for p in Path(path, "cgroup.procs").read_text().split()]
        except OSError:
            return
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


def remove_cgroup(path: str) -> None:
    """Remove an emptied cgroup; one still busy after a second is left behind."""
    for _ in range(100):  # the kernel frees a cgroup a moment after its last process exits
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)
