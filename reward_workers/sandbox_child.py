"""The first code that runs inside the sandbox: set up, drop privileges, guard, run the program.

reward_workers/sandbox.py starts it as `python -I -S -B -c <this file's text> <config json>`
with the program's source on stdin; it is never imported. Standard library only: it may run
on a different interpreter than the trainer's (one an unprivileged user can read).

The audit hook is the in-process layer of the sandbox: it refuses what the kernel layers
(namespaces, an unprivileged uid, rlimits) may not cover where they are unavailable. Audit
hooks are not a security boundary on their own (PEP 578), so the hook keeps its settings in
a closure that the program cannot reach (no globals, gc and tracing refused).
"""

import json
import os
import re
import sys


def _drop_privileges(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid):
        raise SystemExit("sandbox: could not drop privileges")


def _install_audit_hook(workdir: str, allow_subprocess: bool, kernel_confined: bool) -> None:
    root = os.path.realpath(workdir)
    own_proc = f"/proc/{os.getpid()}/"
    other_proc = re.compile(r"/proc/\d+(/|$)")
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    refused = {
        # network (also cut off by the network namespace when there is one)
        "socket.__new__",
        "socket.getaddrinfo",
        "socket.gethostbyname",
        "socket.gethostbyname_ex",
        "socket.gethostbyaddr",
        "socket.getnameinfo",
        # ways to reach this hook's closure or forge code objects
        "sys.settrace",
        "sys.setprofile",
        "gc.get_objects",
        "gc.get_referrers",
        "gc.get_referents",
        "code.__new__",
        # symlinks would let a path that looks inside the workdir lead outside it
        "os.symlink",
        # signals to process groups (os.kill is allowed for the program's own pid only)
        "os.killpg",
    }
    if not allow_subprocess:
        refused |= {
            "os.fork",
            "os.forkpty",
            "os.system",
            "os.exec",
            "os.posix_spawn",
            "os.spawn",
            "subprocess.Popen",
            "pty.spawn",
        }
    # _posixsubprocess.fork_exec raises no audit event, and ctypes can do anything. Any
    # component of a dotted name counts: an extension module loads under any package name.
    refused_modules = {"ctypes", "_ctypes"} | (set() if allow_subprocess else {"_posixsubprocess"})
    # memfd pages escape RLIMIT_AS (the memory cgroup is the wall where there is one).
    for module in (os, sys.modules.get("posix")):
        if module is not None and hasattr(module, "memfd_create"):
            delattr(module, "memfd_create")
    # event -> (positions of paths that must stay inside the workdir, positions of dir_fd args)
    path_events = {
        "os.remove": ((0,), (1,)),
        "os.rmdir": ((0,), (1,)),
        "os.mkdir": ((0,), (2,)),
        "os.rename": ((0, 1), (2, 3)),
        "os.link": ((0, 1), (2, 3)),
        "os.chmod": ((0,), (2,)),
        "os.chown": ((0,), (3,)),
        "os.chflags": ((0,), ()),
        "os.truncate": ((0,), ()),
        "os.utime": ((0,), (3,)),
        "os.setxattr": ((0,), ()),
        "os.removexattr": ((0,), ()),
        "os.chdir": ((0,), ()),
        "sqlite3.connect": ((0,), ()),
    }

    def resolve(path: object) -> str | None:
        if isinstance(path, int):  # a descriptor: where it points
            try:
                return os.readlink(f"/proc/self/fd/{path}")
            except OSError:
                return None
        try:
            return os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return None

    def inside(path: str | None) -> bool:
        return path is not None and (path == root or path.startswith(root + "/"))

    def check_open(path: object, mode: str | None, flags: int) -> None:
        if isinstance(path, int):  # wrapping a descriptor opened earlier (and checked then)
            return
        resolved = resolve(path)
        if resolved is None:
            raise PermissionError("sandbox: unresolvable path")
        writing = (mode is not None and any(c in mode for c in "wax+")) or flags & write_flags
        if writing and not inside(resolved):
            raise PermissionError(f"sandbox: writing outside the work directory: {resolved}")
        if other_proc.match(resolved) and not resolved.startswith(own_proc):
            raise PermissionError("sandbox: other processes are off limits")
        # os.open of an outside directory would give a dir_fd that escapes the path checks
        if mode is None and not inside(resolved) and os.path.isdir(resolved):
            raise PermissionError("sandbox: directory descriptors outside the work directory")

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            # With the kernel layers, the read-only root is the wall for writes; the hook's
            # path checks would only refuse what the program may do (tempfile, unlink).
            if not kernel_confined:
                check_open(*args[:3])
        elif event in refused:
            raise PermissionError(f"sandbox: {event} is not allowed")
        elif event == "import":
            name = str(args[0])
            filename = os.path.basename(str(args[1])) if len(args) > 1 and args[1] else ""
            if set(name.split(".")) & refused_modules or filename.startswith("_ctypes"):
                raise PermissionError(f"sandbox: importing {name} is not allowed")
        elif event == "os.kill":
            if args[0] != os.getpid():
                raise PermissionError("sandbox: signalling other processes is not allowed")
        elif event in path_events and not kernel_confined:
            paths, dir_fds = path_events[event]
            # Without a dir_fd CPython reports None or a negative default (-1): the paths are
            # then relative to the current directory.
            fds = [
                args[i]
                for i in dir_fds
                if i < len(args) and not (args[i] is None or (type(args[i]) is int and args[i] < 0))
            ]
            if fds:  # shutil.rmtree works this way: a plain name in a directory inside
                plain = all(os.sep not in os.fsdecode(args[i]) for i in paths)
                if not plain or not all(inside(resolve(fd)) for fd in fds):
                    raise PermissionError(f"sandbox: {event} with this dir_fd is not allowed")
                return
            for i in paths:
                if not inside(resolve(args[i])):
                    raise PermissionError(f"sandbox: {event} outside the work directory")

    sys.addaudithook(hook)


def _main() -> None:
    config = json.loads(sys.argv[1])
    source = sys.stdin.buffer.read()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    workdir, uid, gid = config["workdir"], config["uid"], config["gid"]
    if config["new_root"] is not None:  # the minimal root built by the namespace's init
        os.chroot(config["new_root"])
        os.chdir("/")
    if config["create_workdir"]:  # inside the private tmpfs of the mount namespace
        os.mkdir(workdir, 0o700)
        if uid is not None:
            os.chown(workdir, uid, gid)
    os.chdir(workdir)
    if uid is not None:
        _drop_privileges(uid, gid)
    code = compile(source, "<program>", "exec")
    _install_audit_hook(workdir, config["allow_subprocess"], config["kernel_confined"])
    sys.argv = ["<program>"]
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})


_main()
