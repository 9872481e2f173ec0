"""The namespaces a sandbox runs in (util-linux `unshare`: user where the worker is not root,
mount, network, PID, IPC, UTS) and the minimal root built inside the mount namespace: a fresh
read-only tmpfs holding only read-only, nosuid bind mounts of the interpreter, its standard
library (site-packages and ctypes masked) and the shared-library directories its extension
modules link against, four /dev nodes, and a size-capped noexec /tmp for the work directory.
No /proc, no dataset, no package code."""

from __future__ import annotations

import glob
import json
import os
import shlex
import subprocess
from pathlib import Path

from groupflow.reward_workers.sandbox.platform import SandboxPlatform

# The program's work directory inside the namespace (on the private /tmp).
WORKDIR = "/tmp/work"
# Where the new root is assembled inside the private mount namespace (hidden from the host).
NEW_ROOT = "/tmp"
# The uid the program runs as in a nested user namespace when the worker is not root.
_INNER_ID = 1000
_DEV_NODES = ("null", "zero", "urandom", "random")


def namespace_prefix(unshare: str, as_root: bool) -> tuple[str, ...]:
    """The command line that runs a command in fresh namespaces (and, where the worker is not
    root, a user namespace mapping it to root there), killed when `unshare` dies."""
    user_ns = () if as_root else ("--user", "--map-root-user")
    return (
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


def namespace_init(platform: SandboxPlatform, disk_mb: int, nested_user: bool) -> str:
    """The script (`sh -c`) of the namespace's first process: builds the minimal root (a
    `disk_mb` /tmp), then runs the bootstrap as its child, not with exec, so that the program is not the namespace's init (which signals from
    inside cannot kill) and its death by a signal comes back as an exit status of 128 +
    signal (unshare does not pass those on reliably)."""
    q = shlex.quote
    root = NEW_ROOT
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
    size_kib = disk_mb * 1024
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


_LAYOUT_QUERY = (
    "import json, sys, sysconfig\n"
    "print(json.dumps([sysconfig.get_path('stdlib'), sysconfig.get_path('platstdlib'),"
    " sysconfig.get_path('purelib'), sysconfig.get_path('platlib')]))"
)


def root_contents(
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
