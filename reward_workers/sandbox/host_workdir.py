"""The work directory of a sandbox without a mount namespace: a fresh directory of the
worker's on the host holding the program's `work` directory, and its removal, which follows
no link the program planted."""

from __future__ import annotations

import os
import tempfile


def make_host_workdir(uid: int | None, gid: int | None) -> tuple[str, str]:
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


def remove_tree(path: str) -> None:
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
