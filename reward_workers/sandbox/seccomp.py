"""The syscall filter (seccomp): system calls no sandboxed program needs that reach past the
rlimits or out of the sandbox, refused by the kernel (EPERM) whatever the program runs.

Always refused: memory no rlimit counts (memfd), other processes (pidfds, ptrace,
process_vm_*), System V IPC objects that outlive the run. Without namespaces, also device
nodes, FIFOs and symlinks (the audit hook's path checks see none of them), and signals,
rlimits and scheduling of any process but the program's own (its parent is the same user
where the worker is not root). Built in the worker, installed between fork and exec (run.py);
it survives exec and binds every process the program starts. An architecture not listed here
gets no filter, and the platform says so.
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
from dataclasses import dataclass

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
