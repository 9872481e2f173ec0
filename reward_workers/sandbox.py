"""Run untrusted Python (model-written code) in a contained child process.

The kernel is the main wall; docs/sandbox.md says which platform gives which guarantees.
Layers, outermost first (`SandboxPlatform.isolation` lists the ones active on this machine):
- Parent-death signal (util-linux `setpriv --pdeathsig`): a sandbox dies with the process that
  started it, so a killed scorer leaves nothing running.
- A memory cgroup per run where the host lets us create one: every page the program touches
  (memfd, tmpfs, shared memory included, which RLIMIT_AS does not see) is charged to a cap,
  and every process in it is killed at the end, wherever it went.
- Namespaces via util-linux `unshare`: network (loopback only, down), PID (the program sees
  only its own processes; when the namespace's first process dies the kernel kills the
  rest), IPC (System V objects die with the run), UTS and mount. In the mount namespace the
  program's root is a fresh read-only tmpfs holding only read-only, nosuid bind mounts of
  the interpreter, its standard library (site-packages and ctypes masked) and the shared
  library directories its extension modules link against, four /dev nodes, and a
  size-capped noexec /tmp with the work directory. No /proc, no dataset, no package code.
- An unprivileged uid without capabilities: as root, a fresh uid/gid per run; as a
  non-root user, a non-zero uid in a nested user namespace (so the program cannot unmount).
- rlimits set in preexec: CPU seconds, address space, processes, file size, open files, no
  core dumps; a wall-clock timeout; a new session whose process group is killed on exit.
- A seccomp filter set in preexec (build_syscall_filter): memfd, pidfds, ptrace, System V
  IPC; without namespaces also mknod, symlink and signals to any process but the program.
- A stripped environment (PATH, HOME, TMPDIR, LANG only) and `python -I -S -B`.
- An audit hook inside the child (sandbox_child.py), a second layer only: sockets,
  subprocesses (unless allowed), signals to other processes, ctypes, native code from
  outside the standard library; where the kernel layers are missing, also writes outside
  the work directory. It holds no state the program could change.
Without namespaces the work directory lives in a fresh directory of the worker's, and its
cleanup follows no link the program planted (_remove_tree).

Output is captured in unlinked temporary files, bounded by RLIMIT_FSIZE, and read back up to
`Limits.output_bytes`.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import json
import os
import random
import resource
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO

_CHILD_SOURCE = (Path(__file__).parent / "sandbox_child.py").read_text()
_NAMESPACE_WORKDIR = "/tmp/work"
# Where the new root is assembled inside the private mount namespace (hidden from the host).
_NEW_ROOT = "/tmp"
# The uid the program runs as in a nested user namespace when the worker is not root.
_INNER_ID = 1000
_DEV_NODES = ("null", "zero", "urandom", "random")


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


@dataclass(frozen=True)
class SandboxPlatform:
    """How this machine can isolate a child, found once by probing (see probe_platform)."""

    python: str
    namespace_prefix: tuple[str, ...]  # the unshare command line, or () when unavailable
    drop_privileges: bool  # the worker is root: run as a fresh uid
    pdeathsig_prefix: tuple[str, ...] = ()
    memory_cgroup: str | None = None  # a directory we may create per-run cgroups in
    cgroup_v2: bool = False
    visible: tuple[str, ...] = ()  # host paths bound read-only into the new root
    masked: tuple[str, ...] = ()  # paths inside those hidden again (site-packages, ctypes)
    links: tuple[tuple[str, str], ...] = ()  # symlinks to recreate in the new root
    syscall_filter: bool = False  # seccomp works here (see build_syscall_filter)

    @property
    def isolation(self) -> tuple[str, ...]:
        layers = ["rlimits", "session", "clean-env", "audit-hook"]
        if self.drop_privileges or self.namespace_prefix:
            layers.append("unprivileged-uid")
        if self.namespace_prefix:
            layers += [
                "net-namespace",
                "pid-namespace",
                "ipc-namespace",
                "mount-namespace",
                "minimal-root",
            ]
        if self.pdeathsig_prefix:
            layers.append("parent-death-signal")
        if self.memory_cgroup:
            layers.append("memory-cgroup")
        if self.syscall_filter:
            layers.append("syscall-filter")
        return tuple(layers)

    @property
    def missing(self) -> tuple[str, ...]:
        """Kernel layers docs/sandbox.md calls required for code rewards, absent here."""
        wanted = ("minimal-root", "ipc-namespace", "parent-death-signal", "memory-cgroup")
        return tuple(layer for layer in wanted if layer not in self.isolation)


class SandboxUnavailable(RuntimeError):
    pass


def require_strong(platform: SandboxPlatform, allow_weak: bool, who: str) -> None:
    """Refuse (one line) to run model code where the kernel layers are missing, unless the
    user opted out."""
    if platform.missing and not allow_weak:
        raise ValueError(
            f"{who}: this machine's sandbox lacks {', '.join(platform.missing)} "
            "(see docs/sandbox.md); set task option allow_weak_sandbox=true to run anyway"
        )


def run_python(
    source: str,
    limits: Limits = Limits(),
    *,
    allow_subprocess: bool = False,
    platform: SandboxPlatform | None = None,
) -> SandboxResult:
    """Run `source` as a program in the sandbox and return what it printed and how it ended."""
    platform = platform or default_platform()
    namespaces = bool(platform.namespace_prefix)
    uid, gid = _fresh_ids() if platform.drop_privileges else (None, None)
    host_dir, workdir = (None, _NAMESPACE_WORKDIR) if namespaces else _make_host_workdir(uid, gid)
    config = {
        "workdir": workdir,
        "new_root": _NEW_ROOT if namespaces and uid is not None else None,
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
            _namespace_init(platform, limits, nested_user=uid is None),
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
                _kill_cgroup(cgroup)
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
            _remove_cgroup(cgroup)
        if host_dir is not None:
            _remove_tree(host_dir)


def _namespace_init(platform: SandboxPlatform, limits: Limits, nested_user: bool) -> str:
    """The namespace's first process: builds the minimal root, then runs the bootstrap as its
    child, not with exec, so that the program is not the namespace's init (which signals from
    inside cannot kill) and its death by a signal comes back as an exit status of 128 +
    signal (unshare does not pass those on reliably)."""
    q = shlex.quote
    root = _NEW_ROOT
    lines = [
        "set -e",
        f"mount -t tmpfs -o size=1024k,mode=755 gf-root {root}",
    ]
    for path in platform.visible:
        inside = q(root + path)
        if os.path.isdir(path):
            lines.append(f"mkdir -p {inside}")
        else:
            lines.append(f"mkdir -p {q(os.path.dirname(root + path))}; : > {inside}")
        lines.append(f"mount --rbind {q(path)} {inside}")
        lines.append(f"mount -o remount,bind,ro,nosuid,nodev {inside}")
    for path in platform.masked:
        inside = q(root + path)
        if os.path.isdir(path):
            lines.append(f"mount -t tmpfs -o ro,size=4k,mode=755 gf-mask {inside}")
        else:
            lines.append(f"mount --bind /dev/null {inside}")
    for link, target in platform.links:
        lines.append(f"[ -e {q(root + link)} ] || ln -s {q(target)} {q(root + link)}")
    lines.append(f"mkdir -p {root}/dev {root}/tmp")
    for node in _DEV_NODES:
        lines.append(f": > {root}/dev/{node}; mount --bind /dev/{node} {root}/dev/{node}")
    size_kib = limits.disk_mb * 1024
    # Owned by this namespace's root, which is the nested namespace's uid 1000.
    lines.append(
        f"mount -t tmpfs -o size={size_kib}k,mode=755,noexec,nosuid,nodev gf-tmp {root}/tmp"
    )
    lines.append(f"mount -o remount,bind,ro,nosuid {root}")
    if nested_user:
        # Root of the outer user namespace could unmount all this; the program is not that
        # root but uid 1000 of a namespace nested inside, with no capabilities over these mounts.
        lines.append(
            f'exec_prefix="unshare --user --map-user={_INNER_ID} --map-group={_INNER_ID} '
            f'--root={root} --"'
        )
    else:
        lines.append('exec_prefix=""')
    lines += ["set +e", '$exec_prefix "$@"', "exit $?"]
    return "\n".join(lines) + "\n"


_platform: SandboxPlatform | None = None


def default_platform() -> SandboxPlatform:
    """The strongest platform here, probed on first use."""
    global _platform
    if _platform is None:
        _platform = probe_platform(namespaces=True)
    return _platform


def probed_platform() -> SandboxPlatform | None:
    """The platform found so far in this process, if any (to hand to scorer processes)."""
    return _platform


def use_platform(platform: SandboxPlatform) -> None:
    """Take a platform probed by the parent process instead of probing again."""
    global _platform
    _platform = platform


def probe_platform(namespaces: bool = True) -> SandboxPlatform:
    """Find an interpreter and the strongest isolation that actually works here.

    `namespaces=False` skips `unshare` and the cgroup (tests use it to exercise the fallback).
    """
    drop = os.geteuid() == 0
    pdeathsig = parent_death_prefix()
    unshare = shutil.which("unshare")
    for python in _python_candidates():
        if namespaces and unshare:
            user_ns = () if drop else ("--user", "--map-root-user")
            prefix = (
                unshare,
                *user_ns,
                "--mount",
                "--net",
                "--pid",
                "--ipc",
                "--uts",
                "--fork",
                "--kill-child",
                "--",
            )
            cgroup, v2 = _find_memory_cgroup()
            visible, masked, links = _root_contents(python)
            candidate = SandboxPlatform(
                python=python,
                namespace_prefix=prefix,
                drop_privileges=drop,
                pdeathsig_prefix=pdeathsig,
                memory_cgroup=cgroup,
                cgroup_v2=v2,
                visible=visible,
                masked=masked,
                links=links,
            )
            if working := _works_with_or_without_filter(candidate):
                return working
    for python in _python_candidates():
        candidate = SandboxPlatform(
            python=python, namespace_prefix=(), drop_privileges=drop, pdeathsig_prefix=pdeathsig
        )
        if working := _works_with_or_without_filter(candidate):
            return working
    raise SandboxUnavailable(
        "sandbox: no Python interpreter runs here under the sandbox (as an unprivileged user "
        "it needs a world-readable standard library, e.g. /usr/bin/python3)"
    )


def parent_death_prefix() -> tuple[str, ...]:
    """A command prefix that makes the command die (SIGKILL) with the process starting it.

    `setpriv --pdeathsig` arms the signal; the shell then checks that the parent is still
    the one that forked it (`$0`, filled in at exec time by the caller), since a parent that
    died between fork and that moment would never deliver it."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return ()
    check = '[ "$PPID" = "$0" ] || exit 137; exec "$@"'
    return (setpriv, "--pdeathsig", "KILL", "--", "/bin/sh", "-c", check)


def with_parent_death(prefix: tuple[str, ...], command: list[str]) -> list[str]:
    """prefix + command, with our pid where the prefix's check expects the parent's."""
    return [*prefix, str(os.getpid()), *command] if prefix else command


def _python_candidates() -> list[str]:
    # The trainer's own interpreter may live in a directory only root can enter (such as
    # /root/.pyenv): the new root makes it reachable; without namespaces the system one is
    # the usual fallback.
    found = [getattr(sys, "_base_executable", sys.executable), sys.executable]
    found += ["/usr/bin/python3", "/usr/local/bin/python3"]
    unique = {}
    for path in found:
        if path and os.access(path, os.X_OK):
            unique.setdefault(os.path.realpath(path), os.path.realpath(path))
    return list(unique)


_LAYOUT_QUERY = (
    "import json, sys, sysconfig\n"
    "print(json.dumps([sysconfig.get_path('stdlib'), sysconfig.get_path('platstdlib'),"
    " sysconfig.get_path('purelib'), sysconfig.get_path('platlib')]))"
)


def _root_contents(
    python: str,
) -> tuple[tuple[str, ...], tuple[str, ...], tuple[tuple[str, str], ...]]:
    """What the new root shows: the interpreter, its standard library and the directories of
    the shared libraries it and its extension modules load; minus site-packages and ctypes."""
    try:
        out = subprocess.run(
            [python, "-I", "-S", "-c", _LAYOUT_QUERY], capture_output=True, text=True, timeout=30
        ).stdout
        stdlib, platstdlib, purelib, platlib = json.loads(out)
    except (OSError, subprocess.SubprocessError, ValueError):
        return (), (), ()
    stdlibs = {os.path.realpath(p) for p in (stdlib, platstdlib)}
    libraries = {python}
    for directory in stdlibs:
        libraries |= set(glob.glob(os.path.join(directory, "lib-dynload", "*.so")))
    library_dirs = set()
    for path in sorted(_linked_libraries(libraries)):
        library_dirs.add(os.path.dirname(path))
    visible = {python, *stdlibs}
    links = []
    for directory in library_dirs:
        real = os.path.realpath(directory)
        if any(s == real or s.startswith(real + "/") for s in stdlibs):
            continue  # e.g. <prefix>/lib holding libpython, already loaded, and site-packages
        visible.add(real)
        links += _symlinks_on_the_way(directory)
    masked = {os.path.realpath(p) for p in (purelib, platlib) if os.path.isdir(p)}
    for directory in stdlibs:
        masked |= set(glob.glob(os.path.join(directory, "lib-dynload", "_ctypes*.so")))
        if os.path.isdir(os.path.join(directory, "ctypes")):
            masked.add(os.path.join(directory, "ctypes"))
    ordered_visible = tuple(sorted(visible, key=lambda p: (p.count("/"), p)))
    shown = [m for m in masked if any(m.startswith(v + "/") for v in visible)]
    return ordered_visible, tuple(sorted(shown)), tuple(dict.fromkeys(links))


def _linked_libraries(binaries: set[str]) -> set[str]:
    found = set()
    for chunk_start in range(0, len(binaries), 64):
        chunk = sorted(binaries)[chunk_start : chunk_start + 64]
        try:
            out = subprocess.run(["ldd", *chunk], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        for line in out.splitlines():
            words = line.split()
            for word in words:
                if word.startswith("/") and os.path.exists(word) and not word.endswith(":"):
                    found.add(word)
    return found


def _symlinks_on_the_way(path: str) -> list[tuple[str, str]]:
    """The symlinked ancestors of path (/lib -> usr/lib on merged-/usr systems)."""
    links = []
    current = ""
    for part in Path(path).parts[1:]:
        current += "/" + part
        if os.path.islink(current):
            links.append((current, os.readlink(current)))
    return links


def _find_memory_cgroup() -> tuple[str | None, bool]:
    """A cgroup directory of ours where we may create children with a memory limit."""
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


def _make_cgroup(platform: SandboxPlatform, limits: Limits) -> str | None:
    if platform.memory_cgroup is None:
        return None
    _remove_orphaned_cgroups(platform.memory_cgroup)
    path = f"{platform.memory_cgroup}/gf-sandbox-{os.getpid()}-{random.getrandbits(48):x}"
    os.mkdir(path)
    # The program's own memory, its tmpfs and the interpreter/shell overhead.
    cap = (limits.memory_mb + limits.disk_mb + 64) * 1024 * 1024
    settings = (
        {"memory.max": cap, "memory.swap.max": 0}
        if platform.cgroup_v2
        else {"memory.limit_in_bytes": cap, "memory.memsw.limit_in_bytes": cap}
    )
    for name, value in settings.items():
        try:
            Path(path, name).write_text(str(value))
        except OSError:
            if "swap" not in name and "memsw" not in name:  # swap accounting may be off
                os.rmdir(path)
                raise
    return path


def _remove_orphaned_cgroups(base: str) -> None:
    """Cgroups of scorers that were killed mid-run (their sandboxes died with them, by the
    parent-death signal; the empty directories stay until someone removes them)."""
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if name.startswith("gf-sandbox-") and len(parts) == 4 and parts[2].isdigit():
            if not os.path.exists(f"/proc/{parts[2]}"):
                _kill_cgroup(f"{base}/{name}")
                _remove_cgroup(f"{base}/{name}")


def _kill_cgroup(path: str) -> None:
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


def _remove_cgroup(path: str) -> None:
    for _ in range(100):  # the kernel frees a cgroup a moment after its last process exits
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)


def _works_with_or_without_filter(platform: SandboxPlatform) -> SandboxPlatform | None:
    """The platform with the syscall filter if that works here, else without, else None."""
    for syscall_filter in dict.fromkeys((build_syscall_filter(False) is not None, False)):
        candidate = replace(platform, syscall_filter=syscall_filter)
        if _works(candidate):
            return candidate
    return None


def _works(platform: SandboxPlatform) -> bool:
    # Importing after the privilege drop proves the standard library is readable.
    probe = "import fractions, json\nprint(json.dumps(str(fractions.Fraction(1, 2))))"
    limits = Limits(wall_s=10.0, cpu_s=5)
    try:
        result = run_python(probe, limits, platform=platform)
    except (OSError, subprocess.SubprocessError):  # SubprocessError: seccomp refused
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


def _enter_child(
    limits: Limits, nproc: int, cgroup: str | None, syscall_filter: SyscallFilter | None
) -> None:
    # preexec_fn runs in the child between fork and exec, where a lock held by another
    # thread of the worker at fork time could deadlock it: only raw system calls here.
    if cgroup is not None:
        fd = os.open(f"{cgroup}/cgroup.procs", os.O_WRONLY)
        try:
            os.write(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)
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


def _make_host_workdir(uid: int | None, gid: int | None) -> tuple[str, str]:
    """Without a mount namespace: a fresh directory of the worker's holding the program's
    work directory. Under a sandbox uid the program cannot write that parent, so it cannot
    rename its work directory away or put a link in its place for the cleanup to follow."""
    parent = tempfile.mkdtemp(prefix="gf-sandbox-")
    workdir = os.path.join(parent, "work")
    os.mkdir(workdir, 0o700)
    if uid is not None:
        os.chmod(parent, 0o711)  # the sandbox uid may pass through it, not list or change it
        os.chown(workdir, uid, gid)
    return parent, workdir


def _remove_tree(path: str) -> None:
    """Remove a host work directory without following any link the program planted: every
    step goes through a descriptor opened O_NOFOLLOW, so a link is removed, never entered,
    and a mode is only ever changed on a directory of the tree itself."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return  # gone, or no longer a directory: nothing of ours is there to remove
    try:
        _empty_directory(fd)
    except RecursionError:
        pass  # nested past Python's stack: left behind like any entry that cannot go
    finally:
        os.close(fd)
    _remove_quietly(os.rmdir, path)


def _empty_directory(fd: int) -> None:
    for name in os.listdir(fd):
        try:
            child = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY, dir_fd=fd)
        except OSError:  # a file, a link, a fifo: unlinked as it is
            _remove_quietly(os.unlink, name, dir_fd=fd)
            continue
        try:
            # The program may have made its directories unreadable to the worker (the same
            # user where it is not root): chmod through the descriptor, which is that very
            # directory whatever its name leads to by now.
            os.chmod(f"/proc/self/fd/{child}", 0o700)
            readable = os.open(f"/proc/self/fd/{child}", os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue
        finally:
            os.close(child)
        try:
            _empty_directory(readable)
        finally:
            os.close(readable)
        _remove_quietly(os.rmdir, name, dir_fd=fd)


def _remove_quietly(remove, *args, **kwargs) -> None:
    try:
        remove(*args, **kwargs)
    except OSError:
        pass  # an entry left behind is not worth failing a verdict over


# --- The syscall filter ---------------------------------------------------------------------
# System calls no sandboxed program needs that reach past the rlimits or out of the sandbox,
# refused by the kernel (EPERM) whatever the program runs: memory no rlimit counts (memfd),
# other processes (pidfds, ptrace, process_vm_*), System V IPC objects that outlive the run.
# Without namespaces, also device nodes, FIFOs and symlinks (the audit hook's path checks see
# none of them), and signals, rlimits and scheduling of any process but the program's own
# (its parent is the same user where the worker is not root). Built in the worker, installed between fork and exec;
# it survives exec and binds every process the program starts. An architecture not listed
# here gets no filter, and the platform says so.

_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_RET_ALLOW = 0x7FFF0000
_RET_EPERM = 0x00050000 | 1
_RET_KILL_PROCESS = 0x80000000
_LOAD_WORD = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JUMP_IF_EQUAL = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JUMP_IF_AT_LEAST = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_RETURN = 0x06  # BPF_RET | BPF_K
# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6]
_NR, _ARCH, _FIRST_ARG_LOW_WORD = 0, 4, 16
_X32_SYSCALL_BIT = 0x40000000


@dataclass(frozen=True)
class _Arch:
    audit_arch: int
    numbers: dict[str, int]
    has_x32: bool  # x86_64 also takes x32 calls, numbered from _X32_SYSCALL_BIT


_ARCHES = {
    "x86_64": _Arch(
        0xC000003E,
        {
            "memfd_create": 319,
            "memfd_secret": 447,
            "pidfd_open": 434,
            "pidfd_send_signal": 424,
            "pidfd_getfd": 438,
            "process_vm_readv": 310,
            "process_vm_writev": 311,
            "ptrace": 101,
            "shmget": 29,
            "msgget": 68,
            "semget": 64,
            "mknod": 133,
            "mknodat": 259,
            "symlink": 88,
            "symlinkat": 266,
            "kill": 62,
            "tkill": 200,
            "tgkill": 234,
            "rt_sigqueueinfo": 129,
            "rt_tgsigqueueinfo": 297,
            "prlimit64": 302,
            "sched_setaffinity": 203,
            "sched_setscheduler": 144,
            "sched_setparam": 142,
            "sched_setattr": 314,
            "setpriority": 141,
            "ioprio_set": 251,
        },
        has_x32=True,
    ),
    "aarch64": _Arch(
        0xC00000B7,
        {
            "memfd_create": 279,
            "memfd_secret": 447,
            "pidfd_open": 434,
            "pidfd_send_signal": 424,
            "pidfd_getfd": 438,
            "process_vm_readv": 270,
            "process_vm_writev": 271,
            "ptrace": 117,
            "shmget": 194,
            "msgget": 186,
            "semget": 190,
            "mknodat": 33,
            "symlinkat": 36,
            "kill": 129,
            "tkill": 130,
            "tgkill": 131,
            "rt_sigqueueinfo": 138,
            "rt_tgsigqueueinfo": 240,
            "prlimit64": 261,
            "sched_setaffinity": 122,
            "sched_setscheduler": 119,
            "sched_setparam": 118,
            "sched_setattr": 274,
            "setpriority": 140,
            "ioprio_set": 30,
        },
        has_x32=False,
    ),
}
_ALWAYS_REFUSED = (
    "memfd_create",
    "memfd_secret",
    "pidfd_open",
    "pidfd_send_signal",
    "pidfd_getfd",
    "process_vm_readv",
    "process_vm_writev",
    "ptrace",
    "shmget",
    "msgget",
    "semget",
)
# Without namespaces: device nodes, FIFOs and links, which the audit hook's path checks do not
# see, and other processes' priorities (their target is not the first argument).
_REFUSED_WITHOUT_NAMESPACES = (
    "mknod",
    "mknodat",
    "symlink",
    "symlinkat",
    "setpriority",
    "ioprio_set",
)
# Their first argument is the target pid (or thread group): allowed for the program itself,
# 0 (itself, or its own process group) and -pid (its own process group).
_PID_TARGETED_CALLS = (
    "kill",
    "tkill",
    "tgkill",
    "rt_sigqueueinfo",
    "rt_tgsigqueueinfo",
    "prlimit64",
    "sched_setaffinity",
    "sched_setscheduler",
    "sched_setparam",
    "sched_setattr",
)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


@dataclass(frozen=True)
class SyscallFilter:
    """A BPF program ready to install; the program's own pid is filled in at install time
    (it is only known in the forked child)."""

    instructions: ctypes.Array
    fprog: _SockFprog
    own_pid_offsets: tuple[int, ...]  # byte offsets of the k fields compared with the pid
    own_group_offsets: tuple[int, ...]  # ... and with -pid

    def install(self) -> None:
        """Install in the calling process (the forked child, before exec). Raw calls only:
        this runs between fork and exec."""
        pid = os.getpid()
        for offset in self.own_pid_offsets:
            struct.pack_into("=I", self.instructions, offset, pid)
        for offset in self.own_group_offsets:
            struct.pack_into("=I", self.instructions, offset, -pid & 0xFFFFFFFF)
        prctl = _prctl()
        if prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        address = ctypes.addressof(self.fprog)
        if prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, address, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")


@functools.cache
def _prctl():
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


@functools.cache
def build_syscall_filter(without_namespaces: bool) -> SyscallFilter | None:
    """The filter for this machine's architecture, or None where it has none.
    `without_namespaces`: no PID namespace hides other processes, so the filter must."""
    arch = _ARCHES.get(os.uname().machine)
    if arch is None:
        return None
    _prctl()  # loaded now: the child only calls it
    refused = _ALWAYS_REFUSED + (_REFUSED_WITHOUT_NAMESPACES if without_namespaces else ())
    pid_targeted = _PID_TARGETED_CALLS if without_namespaces else ()
    # (code, jump-if-true label, jump-if-false label, k); labels resolve to relative offsets
    program: list[tuple[int, str | None, str | None, int]] = [
        (_LOAD_WORD, None, None, _ARCH),
        (_JUMP_IF_EQUAL, None, "kill", arch.audit_arch),
        (_LOAD_WORD, None, None, _NR),
    ]
    if arch.has_x32:
        program.append((_JUMP_IF_AT_LEAST, "deny", None, _X32_SYSCALL_BIT))
    program += [
        (_JUMP_IF_EQUAL, "deny", None, arch.numbers[n]) for n in refused if n in arch.numbers
    ]
    program += [(_JUMP_IF_EQUAL, "pid", None, arch.numbers[n]) for n in pid_targeted]
    program.append((_RETURN, None, None, _RET_ALLOW))
    labels = {"kill": len(program)}
    program.append((_RETURN, None, None, _RET_KILL_PROCESS))  # another ABI (i386 on x86_64)
    own_pid_at = len(program) + 1
    if pid_targeted:
        labels["pid"] = len(program)
        program += [
            (_LOAD_WORD, None, None, _FIRST_ARG_LOW_WORD),
            (_JUMP_IF_EQUAL, "allow", None, 0),  # placeholder: the program's pid
            (_JUMP_IF_EQUAL, "allow", None, 0),  # placeholder: -pid, its process group
            (_JUMP_IF_EQUAL, "allow", None, 0),  # 0: the caller itself or its group
        ]
    labels["deny"] = len(program)
    program.append((_RETURN, None, None, _RET_EPERM))
    if pid_targeted:  # BPF jumps only forward: the pid checks' allow comes last
        labels["allow"] = len(program)
        program.append((_RETURN, None, None, _RET_ALLOW))
    encoded = b"".join(
        struct.pack("=HBBI", code, _offset(labels, yes, i), _offset(labels, no, i), k)
        for i, (code, yes, no, k) in enumerate(program)
    )
    instructions = ctypes.create_string_buffer(encoded, len(encoded))
    fprog = _SockFprog(len(program), ctypes.addressof(instructions))
    k_field = 4  # within an 8-byte instruction
    return SyscallFilter(
        instructions=instructions,
        fprog=fprog,
        own_pid_offsets=(own_pid_at * 8 + k_field,) if pid_targeted else (),
        own_group_offsets=((own_pid_at + 1) * 8 + k_field,) if pid_targeted else (),
    )


def _offset(labels: dict[str, int], label: str | None, at: int) -> int:
    return 0 if label is None else labels[label] - at - 1
