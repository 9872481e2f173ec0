"""Finding the strongest platform that works here (`probe_platform`: each candidate is tried
with a real program), and the one this process uses: probed on first use, or handed down by
the parent process (a scorer process takes its worker's)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import replace

from groupflow.reward_workers.sandbox.cgroups import find_memory_cgroup
from groupflow.reward_workers.sandbox.namespaces import namespace_prefix, root_contents
from groupflow.reward_workers.sandbox.platform import (
    SandboxPlatform,
    SandboxUnavailable,
    parent_death_prefix,
)
from groupflow.reward_workers.sandbox.run import Limits, run_program
from groupflow.reward_workers.sandbox.seccomp import build_syscall_filter

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
            cgroup, v2 = find_memory_cgroup()
            visible, masked, links = root_contents(python)
            candidate = SandboxPlatform(
                python=python,
                namespace_prefix=namespace_prefix(unshare, as_root=drop),
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
        result = run_program(probe, limits, platform)
    except (OSError, subprocess.SubprocessError):  # SubprocessError: seccomp refused
        return False
    return result.returncode == 0 and result.stdout.strip() == '"1/2"'
