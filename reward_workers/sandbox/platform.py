"""What this machine offers a sandbox (`SandboxPlatform`, found by probe.py), and the refusal
of a platform whose kernel layers are missing; the parent-death prefix every sandboxed
command (and every scorer process) starts under."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass


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
