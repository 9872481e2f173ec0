"""A learner rank's host memory: what it holds resident, its peak over a step, and the freed
heap given back to the system between micro-batches.

On a CPU rank every tensor is glibc malloc's. A micro-batch frees its activations when its
backward ends, but glibc keeps freed blocks of up to 32 MiB in its heap (its mmap threshold
rises to the largest block freed), where the next micro-batch's blocks of other sizes
fragment it: the heap, resident as a whole, grows to several times what is allocated at any
moment, and Ray's memory monitor counts all of it. `release_freed_memory` hands the heap's free
pages back (malloc_trim), so what a rank holds after a micro-batch is what it allocates, and
`map_large_blocks` keeps the large blocks (activations) out of the heap in the first place, so
that within a micro-batch too a rank holds about what it allocates.
Linux-only figures read /proc; elsewhere they are 0 and the release does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache


@cache
def _libc():
    """glibc, or None where malloc is another's (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim  # noqa: B018 (glibc only)
    except (OSError, AttributeError, TypeError):
        return None
    return libc


# glibc's own starting threshold: a block of 128 KiB or more is mapped apart from the heap.
_MMAP_THRESHOLD = 128 << 10
_M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)


def map_large_blocks() -> None:
    """Keep every block of 128 KiB or more out of the heap, in a mapping of its own that its
    free unmaps: a micro-batch's activations then leave no freed holes for the next ones'
    blocks to fragment. glibc raises its threshold to the largest block freed (up to 32 MiB),
    so a CPU rank's activations would otherwise land in the heap; fixing it stops that. The
    cost, a page fault per fresh page of a large block, is small beside the math on it."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)


def allocator_env() -> dict[str, str]:
    """The environment a CPU rank's process starts with (glibc reads its tunables only then):
    malloc asks for transparent huge pages on the blocks it maps (madvise), so a fresh 2 MiB
    of activations costs one page fault instead of 512. Each large block being a fresh
    mapping (`map_large_blocks`), those faults were a fifth of a 27M model's step on a CPU
    rank; with huge pages the first step took 86 s instead of 96 s, at the same peak
    (bench/learner_memory.py --rank --world 2, docs/learner_memory.md). Where the kernel's
    transparent huge pages are off (`never`), the setting does nothing."""
    return {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


def release_freed_memory() -> None:
    """Give the heap's free pages back to the system (glibc's malloc_trim(0))."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def _status_bytes(key: str) -> int:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def resident_bytes() -> int:
    """This process's resident memory now (VmRSS)."""
    return _status_bytes("VmRSS:")


def peak_resident_bytes() -> int:
    """This process's largest resident memory since `reset_peak` (VmHWM)."""
    return _status_bytes("VmHWM:")


def reset_peak() -> None:
    """Start the peak (`peak_resident_bytes`) afresh from what is resident now."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        pass
