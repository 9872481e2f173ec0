"""Run untrusted Python (model-written code) in a contained child process.

Layers, outermost first (`SandboxPlatform.isolation` lists the ones active on this machine):
- Namespaces via util-linux `unshare` when it works here: a network namespace (only a
  loopback interface, left down: no network at all, not even localhost), a PID namespace (the program sees only its own
  processes and cannot signal anything outside; when its first process dies the kernel kills
  the rest) and a mount namespace where /tmp is a fresh size-capped noexec tmpfs holding the
  work directory and the other world-writable directories are empty read-only mounts. We
  prefer this to an in-process socket block because it holds for native code and for
  subprocesses too; without `unshare` the audit hook's socket refusal is the only barrier.
- When the worker is root: the program runs as a fresh unprivileged uid/gid (random per run),
  so file permissions protect the machine, RLIMIT_NPROC applies (root ignores it) and
  concurrent runs cannot signal each other.
- rlimits set in preexec: CPU seconds, address space, processes, file size, open files, no
  core dumps; a wall-clock timeout; a new session whose process group is killed on exit.
- A stripped environment (PATH, HOME, TMPDIR, LANG only) and `python -I -S -B`.
- An audit hook inside the child (sandbox_child.py) refusing writes outside the work
  directory, sockets, subprocesses (unless allowed), signals to other processes and ctypes.

Output is captured in unlinked temporary files, bounded by RLIMIT_FSIZE, and read back up to
`Limits.output_bytes`.
"""

from __future__ import annotations

import functools
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

_CHILD_SOURCE = (Path(__file__).parent / "sandbox_child.py").read_text()
_NAMESPACE_WORKDIR = "/tmp/work"
# The namespace's first process: mounts a private /tmp for the work directory and nowhere
# else to write, then runs the bootstrap as its child, not with exec, so that the program is
# not the namespace's init (which signals from inside cannot kill) and its death by a signal
# comes back as an exit status of 128 + signal (unshare does not pass those on reliably).
# $1 is the tmpfs size in KiB.
_NAMESPACE_INIT = """set -e
mount -t tmpfs -o size="$1"k,mode=755,noexec,nosuid,nodev tmpfs /tmp
for d in /var/tmp /dev/shm /run/lock; do
  if [ -d "$d" ]; then mount -t tmpfs -o ro,size=4k,mode=755 tmpfs "$d"; fi
done
shift
set +e
"$@"
exit $?
"""


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 512  # RLIMIT_AS per process
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


@dataclass(frozen=True)
class SandboxPlatform:
    """How this machine can isolate a child, found once by probing (see probe_platform)."""

    python: str
    namespace_prefix: tuple[str, ...]  # the unshare command line, or () when unavailable
    drop_privileges: bool

    @property
    def isolation(self) -> tuple[str, ...]:
        layers = ["rlimits", "session", "clean-env", "audit-hook"]
        if self.drop_privileges:
            layers.append("unprivileged-uid")
        if self.namespace_prefix:
            layers += ["net-namespace", "pid-namespace", "mount-namespace"]
        return tuple(layers)


class SandboxUnavailable(RuntimeError):
    pass


def run_python(
    source: str,
    limits: Limits = Limits(),
    *,
    allow_subprocess: bool = False,
    platform: SandboxPlatform | None = None,
) -> SandboxResult:
    """Run `source` as a program in the sandbox and return what it printed and how it ended."""
    platform = platform or default_platform()
    uid, gid = _fresh_ids() if platform.drop_privileges else (None, None)
    host_workdir = None if platform.namespace_prefix else tempfile.mkdtemp(prefix="gf-sandbox-")
    workdir = host_workdir or _NAMESPACE_WORKDIR
    if host_workdir and uid is not None:
        os.chown(host_workdir, uid, gid)
    config = {
        "workdir": workdir,
        "create_workdir": host_workdir is None,
        "uid": uid,
        "gid": gid,
        "allow_subprocess": allow_subprocess,
    }
    command = [platform.python, "-I", "-S", "-B", "-c", _CHILD_SOURCE, json.dumps(config)]
    if platform.namespace_prefix:
        size_kib = str(limits.disk_mb * 1024)
        command = [
            *platform.namespace_prefix,
            "/bin/sh",
            "-c",
            _NAMESPACE_INIT,
            "sh",
            size_kib,
            *command,
        ]
    env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
    try:
        with (
            tempfile.TemporaryFile() as stdin,
            tempfile.TemporaryFile() as stdout,
            tempfile.TemporaryFile() as stderr,
        ):
            stdin.write(source.encode())
            stdin.seek(0)
            proc = subprocess.Popen(
                command,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                cwd="/",
                env=env,
                start_new_session=True,
                preexec_fn=functools.partial(_apply_limits, limits, _nproc_limit(limits, uid)),
            )
            timed_out = _wait(proc, limits.wall_s)
            if host_workdir is not None and uid is not None:
                _kill_all_processes_of(uid, gid)  # no PID namespace to take them down
            returncode = proc.returncode
            if platform.namespace_prefix and 128 < returncode < 128 + signal.NSIG:
                returncode = 128 - returncode  # the shell's report of death by a signal
            return SandboxResult(
                returncode=returncode,
                stdout=_read_back(stdout, limits.output_bytes),
                stderr=_read_back(stderr, limits.output_bytes),
                timed_out=timed_out,
            )
    finally:
        if host_workdir is not None:
            _remove_tree(host_workdir)


@functools.cache
def default_platform() -> SandboxPlatform:
    return probe_platform(namespaces=True)


def probe_platform(namespaces: bool = True) -> SandboxPlatform:
    """Find an interpreter and the strongest isolation that actually works here.

    `namespaces=False` skips `unshare` (tests use it to exercise the fallback).
    """
    drop = os.geteuid() == 0
    prefixes: list[tuple[str, ...]] = []
    unshare = shutil.which("unshare")
    if namespaces and unshare:
        user_ns = () if drop else ("--map-root-user",)
        prefixes.append(
            (unshare, *user_ns, "--net", "--pid", "--fork", "--kill-child", "--mount-proc", "--")
        )
    prefixes.append(())
    for prefix in prefixes:
        for python in _python_candidates():
            candidate = SandboxPlatform(
                python=python, namespace_prefix=prefix, drop_privileges=drop
            )
            if _works(candidate):
                return candidate
    raise SandboxUnavailable(
        "sandbox: no Python interpreter runs here under the sandbox (as an unprivileged user "
        "it needs a world-readable standard library, e.g. /usr/bin/python3)"
    )


def _python_candidates() -> list[str]:
    # The trainer's own interpreter may live in a directory only root can enter (such as
    # /root/.pyenv); the system one is the usual fallback.
    found = [sys.executable, getattr(sys, "_base_executable", sys.executable)]
    found += ["/usr/bin/python3", "/usr/local/bin/python3"]
    unique = {}
    for path in found:
        if path and os.access(path, os.X_OK):
            unique.setdefault(os.path.realpath(path), path)
    return list(unique)


def _works(platform: SandboxPlatform) -> bool:
    # Importing after the privilege drop proves the standard library is readable.
    probe = "import fractions, json\nprint(json.dumps(str(fractions.Fraction(1, 2))))"
    limits = Limits(wall_s=10.0, cpu_s=5)
    try:
        result = run_python(probe, limits, platform=platform)
    except OSError:
        return False
    return result.returncode == 0 and result.stdout.strip() == '"1/2"'


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


def _apply_limits(limits: Limits, nproc: int) -> None:
    # preexec_fn runs in the child between fork and exec, where a lock held by another
    # thread of the worker at fork time could deadlock it; setrlimit calls take no locks.
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


def _remove_tree(path: str) -> None:
    # The program may have made its directories unreadable; restore access first.
    for dirpath, dirnames, _ in os.walk(path):
        for name in dirnames:
            try:
                os.chmod(os.path.join(dirpath, name), 0o700)
            except OSError:
                pass
    shutil.rmtree(path, ignore_errors=True)
