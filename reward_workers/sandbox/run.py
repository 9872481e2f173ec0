"""One run of a program in the sandbox: the command line (parent-death prefix, namespaces and
the minimal root, the bootstrap child.py), the fresh uid, the rlimits and the syscall filter
set between fork and exec, the cgroup, the wall-clock deadline, and everything killed and
removed at the end. The platform is given: the face (__init__.py) picks the default one.

Output is captured in unlinked temporary files, bounded by RLIMIT_FSIZE, and read back up to
`Limits.output_bytes`.
"""

from __future__ import annotations

import functools
import json
import os
import random
import resource
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from groupflow.reward_workers.sandbox.cgroups import (
    join_cgroup,
    kill_cgroup,
    make_cgroup,
    remove_cgroup,
)
from groupflow.reward_workers.sandbox.host_workdir import make_host_workdir, remove_tree
from groupflow.reward_workers.sandbox.namespaces import NEW_ROOT, WORKDIR, namespace_init
from groupflow.reward_workers.sandbox.platform import SandboxPlatform, with_parent_death
from groupflow.reward_workers.sandbox.seccomp import SyscallFilter, build_syscall_filter

# The bootstrap, run as `python -c` text: never imported (it may run on another interpreter).
_CHILD_SOURCE = (Path(__file__).parent / "child.py").read_text()
# What a run's cgroup adds to the program's memory and disk: the interpreter and shell.
_CGROUP_OVERHEAD_MB = 64


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 512  # RLIMIT_AS per process; the cgroup caps the whole run
    max_processes: int = 8  # RLIMIT_NPROC for the sandbox's uid (threads count too)
    disk_mb: int = 16  # RLIMIT_FSIZE, and the size of the private /tmp
    open_files: int = 64
    output_bytes: int = 1 << 20


@dataclass(frozen=True)
class SandboxResult:
    # Negative: killed by that signal. With namespaces an exit status 128 + n reads the same.
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool


def run_program(
    source: str, limits: Limits, platform: SandboxPlatform, *, allow_subprocess: bool = False
) -> SandboxResult:
    """Run `source` as a program in the sandbox `platform` offers; what it printed and how it
    ended."""
    namespaces = bool(platform.namespace_prefix)
    uid, gid = _fresh_ids() if platform.drop_privileges else (None, None)
    host_dir, workdir = (None, WORKDIR) if namespaces else make_host_workdir(uid, gid)
    config = {
        "workdir": workdir,
        "new_root": NEW_ROOT if namespaces and uid is not None else None,
        "create_workdir": namespaces,
        "uid": uid,
        "gid": gid,
        "allow_subprocess": allow_subprocess,
        "kernel_confined": namespaces,
    }
    command = [platform.python, "-I", "-S", "-B", "-c", _CHILD_SOURCE, json.dumps(config)]
    if namespaces:
        command = [
            *platform.namespace_prefix,
            "/bin/sh",
            "-c",
            namespace_init(platform, limits.disk_mb, nested_user=uid is None),
            "sh",
            *command,
        ]
    command = with_parent_death(platform.pdeathsig_prefix, command)
    env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
    cgroup = _make_cgroup(platform, limits)
    syscall_filter = build_syscall_filter(not namespaces) if platform.syscall_filter else None
    try:
        with (
            tempfile.TemporaryFile() as stdin,
            tempfile.TemporaryFile() as stdout,
            tempfile.TemporaryFile() as stderr,
        ):
            stdin.write(source.encode("utf-8", errors="surrogatepass"))
            stdin.seek(0)
            proc = subprocess.Popen(
                command,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                cwd="/",
                env=env,
                start_new_session=True,
                preexec_fn=functools.partial(
                    _enter_child, limits, _nproc_limit(limits, uid), cgroup, syscall_filter
                ),
            )
            timed_out = _wait(proc, limits.wall_s)
            if cgroup is not None:
                kill_cgroup(cgroup)
            elif host_dir is not None and uid is not None:
                _kill_all_processes_of(uid, gid)  # no PID namespace to take them down
            returncode = proc.returncode
            if namespaces and 128 < returncode < 128 + signal.NSIG:
                returncode = 128 - returncode  # the shell's report of death by a signal
            return SandboxResult(
                returncode=returncode,
                stdout=_read_back(stdout, limits.output_bytes),
                stderr=_read_back(stderr, limits.output_bytes),
                timed_out=timed_out,
            )
    finally:
        if cgroup is not None:
            remove_cgroup(cgroup)
        if host_dir is not None:
            remove_tree(host_dir)


def _make_cgroup(platform: SandboxPlatform, limits: Limits) -> str | None:
    if platform.memory_cgroup is None:
        return None
    # The program's own memory, its tmpfs and the interpreter/shell overhead.
    cap = (limits.memory_mb + limits.disk_mb + _CGROUP_OVERHEAD_MB) * 1024 * 1024
    return make_cgroup(platform.memory_cgroup, platform.cgroup_v2, cap)


# Sandbox uids/gids are drawn from here when this (user) namespace maps it.
_FRESH_ID_RANGE = (1_000_000, 2_000_000_000)
_NOBODY = 65534


def _fresh_ids() -> tuple[int, int]:
    # An id no one else uses: the RLIMIT_NPROC count starts at zero and no other process
    # (including another sandbox) can be signalled or have its files touched.
    return _fresh_id("/proc/self/uid_map"), _fresh_id("/proc/self/gid_map")


def _fresh_id(id_map: str) -> int:
    """A random id from the preferred range; in a container that maps fewer ids (rootless
    runtimes map about 65536), from the largest mapped range above the system ids; else nobody."""
    ranges = []
    with open(id_map) as f:
        for line in f:
            start, _, count = map(int, line.split())
            ranges.append((start, start + count))
    low, high = _FRESH_ID_RANGE
    preferred = [(max(a, low), min(b, high)) for a, b in ranges if min(b, high) > max(a, low)]
    usable = preferred or [(max(a, 10_000), b) for a, b in ranges if b > max(a, 10_000)]
    if not usable:
        return _NOBODY
    start, end = max(usable, key=lambda r: r[1] - r[0])
    return random.SystemRandom().randrange(start, end)


def _nproc_limit(limits: Limits, uid: int | None) -> int:
    if uid is not None:
        return limits.max_processes
    # Without a uid of its own, RLIMIT_NPROC counts every process of the worker's user.
    own_uid = os.getuid()
    existing = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                existing += entry.stat().st_uid == own_uid
            except OSError:
                continue
    return existing + limits.max_processes


def _enter_child(
    limits: Limits, nproc: int, cgroup: str | None, syscall_filter: SyscallFilter | None
) -> None:
    # preexec_fn runs in the child between fork and exec, where a lock held by another
    # thread of the worker at fork time could deadlock it: only raw system calls here.
    if cgroup is not None:
        join_cgroup(cgroup)
    disk = limits.disk_mb * 1024 * 1024
    memory = limits.memory_mb * 1024 * 1024
    for kind, value in (
        (resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1)),
        (resource.RLIMIT_AS, (memory, memory)),
        (resource.RLIMIT_NPROC, (nproc, nproc)),
        (resource.RLIMIT_FSIZE, (disk, disk)),
        (resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files)),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
        resource.setrlimit(kind, value)
    if syscall_filter is not None:
        syscall_filter.install()


def _wait(proc: subprocess.Popen, wall_s: float) -> bool:
    """Wait up to wall_s, then kill the whole process group either way; True if it timed out."""
    try:
        proc.wait(timeout=wall_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    return timed_out


def _kill_all_processes_of(uid: int, gid: int) -> None:
    # kill(-1) from a process running as the sandbox uid reaches every process of that uid,
    # including any that left the process group with setsid.
    subprocess.run(
        ["kill", "-KILL", "-1"],
        user=uid,
        group=gid,
        extra_groups=[],
        env={"PATH": "/usr/bin:/bin"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
    )


def _read_back(stream: IO[bytes], limit: int) -> str:
    stream.seek(0)
    return stream.read(limit).decode("utf-8", errors="replace")
