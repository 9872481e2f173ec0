"""The code sandbox: untrusted Python (model-written code: a code task's answers, the python
tool's programs) run in a contained child process. Callers import this face only:
`run_python` with its `Limits` and `SandboxResult`, the platform (`default_platform`, what
`require_strong` refuses), and the parent-death prefix scorer processes start under.

Threat model
------------
The adversary is the program. A policy under training learns whatever earns reward, so its
code may be hostile on purpose or by accident, and it has the whole standard library.

What is contained, and how (outermost first; `SandboxPlatform.isolation` lists the layers
that work on this machine, docs/sandbox.md which platform gives which):
- Outliving the run: a parent-death signal (`setpriv --pdeathsig`, platform.py) ties the
  sandbox to the process that started it; a new session whose process group is killed at the
  end; the PID namespace's first process takes the rest down with it; the memory cgroup's
  processes are killed by list; without namespaces, every process of the sandbox's uid.
- Exhausting the host: rlimits set between fork and exec (CPU seconds, address space,
  processes, file size, open files, no core dumps) and a wall-clock deadline (run.py); a
  memory cgroup per run charges every page, memfd, tmpfs and shared memory included, which
  RLIMIT_AS does not see, to one cap (cgroups.py).
- Reading the host (the code task's answer key, datasets, package code, /etc, /proc): a mount
  namespace whose root is a fresh read-only tmpfs holding only the interpreter, its standard
  library (site-packages and ctypes masked) and the shared libraries it links (namespaces.py).
- Writing the host: that read-only root, a size-capped noexec /tmp, and an unprivileged uid
  without capabilities (a fresh uid per run where the worker is root; else uid 1000 of a
  nested user namespace, so the program cannot unmount the walls).
- Other processes and the network: PID, IPC, network (loopback only, down) and UTS
  namespaces; the syscall filter (seccomp.py) refuses memfd, pidfds, ptrace, process_vm_*
  and System V IPC, and without namespaces also mknod, symlink and signals, rlimits and
  scheduling of any process but the program's own.
- The worker's secrets: a stripped environment (PATH, HOME, TMPDIR, LANG) and `python -I -S -B`.
- Native code and the interpreter's internals: an audit hook in the child (child.py), a
  second layer only: sockets, subprocesses (unless allowed), ctypes, extension modules from
  outside the standard library, subinterpreters, tracing; where the kernel layers are
  missing, writes outside the work directory. It holds no state the program could change.
- The cleanup turned against the host: without a mount namespace the work directory is
  removed without following any link the program planted (host_workdir.py).

What is not contained:
- The kernel. The program shares the host's kernel: a kernel bug reachable through a system
  call the filter allows is an escape. There is no virtual machine.
- Shared hardware and what any process may ask the kernel: timing and cache side channels,
  the kernel's version, the CPU's load; CPU time up to `Limits.cpu_s` is spent.
- Weak platforms (`SandboxPlatform.missing` not empty): without namespaces the program reads
  every world-readable host file, writes to world-writable directories are refused only by
  the audit hook (no security boundary on its own, PEP 578), and without the memory cgroup
  total memory is bounded only per process. Callers refuse such a platform in one line
  unless the user allowed it (`require_strong`).
- What the program prints: bounded (`Limits.output_bytes`), never trusted; a caller reads it
  as the program's claim (the code task compares the values its harness reports outside the
  sandbox, where the expected ones stay; the python tool hands the text to the model).

Modules: platform.py (what a machine offers), probe.py (finding it, the one this process
uses), namespaces.py (the namespaces and the minimal root), cgroups.py, seccomp.py,
host_workdir.py (the work directory without a mount namespace), run.py (one run), child.py
(the bootstrap inside the sandbox, run as text, never imported).
"""

from __future__ import annotations

from groupflow.reward_workers.sandbox.platform import (
    SandboxPlatform,
    SandboxUnavailable,
    parent_death_prefix,
    require_strong,
    with_parent_death,
)
from groupflow.reward_workers.sandbox.probe import (
    default_platform,
    probe_platform,
    probed_platform,
    use_platform,
)
from groupflow.reward_workers.sandbox.run import Limits, SandboxResult, run_program

__all__ = [
    "Limits",
    "SandboxPlatform",
    "SandboxResult",
    "SandboxUnavailable",
    "default_platform",
    "parent_death_prefix",
    "probe_platform",
    "probed_platform",
    "require_strong",
    "run_python",
    "use_platform",
    "with_parent_death",
]

_DEFAULT_LIMITS = Limits()


def run_python(
    source: str,
    limits: Limits = _DEFAULT_LIMITS,
    *,
    allow_subprocess: bool = False,
    platform: SandboxPlatform | None = None,
) -> SandboxResult:
    """Run `source` as a program in the sandbox and return what it printed and how it ended;
    on `platform`, by default the strongest this machine offers (probed once per process)."""
    return run_program(
        source, limits, platform or default_platform(), allow_subprocess=allow_subprocess
    )
