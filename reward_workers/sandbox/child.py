"""The first code that runs inside the sandbox: set up, drop privileges, guard, run the program.

reward_workers/sandbox/run.py starts it as `python -I -S -B -c <this file's text> <config json>`
with the program's source on stdin; it is never imported. Standard library only: it may run
on a different interpreter than the trainer's (one an unprivileged user can read).

The audit hook is the in-process layer of the sandbox: it refuses what the kernel layers
(namespaces, an unprivileged uid, rlimits, the syscall filter) may not cover where they are
unavailable. Audit hooks are not a security boundary on their own (PEP 578). The program can
reach the hook's frames (a traceback of a refusal holds one) and every module, so the hook
holds nothing it could change: its whole state is in its functions' positional defaults,
immutable values and C functions taken before the program runs; its code reads no global or
builtin name (a patched `os.path.realpath`, `builtins.str` or `__main__` global changes
nothing) and calls no method of an object the program made (a `str` subclass's `__str__`, a
path-like's `__fspath__` would run the program's code inside the hook).
"""

import json
import os
import re
import sys
import types

# Ways to reach objects the hook depends on, or to watch it run.
_REFUSED_EVENTS = frozenset(
    {
        # network (also cut off by the network namespace when there is one)
        "socket.__new__",
        "socket.getaddrinfo",
        "socket.gethostbyname",
        "socket.gethostbyname_ex",
        "socket.gethostbyaddr",
        "socket.getnameinfo",
        # tracing and profiling see the hook's live frames
        "sys.settrace",
        "sys.setprofile",
        "gc.get_objects",
        "gc.get_referrers",
        "gc.get_referents",
        "code.__new__",
        # a subinterpreter runs without this interpreter's audit hooks
        "cpython.PyInterpreterState_New",
        # symlinks would let a path that looks inside the workdir lead outside it
        "os.symlink",
        # signals to process groups (os.kill is allowed for the program's own pid only)
        "os.killpg",
    }
)
# ctypes raises these whatever name it was loaded under; sys.monitoring callbacks see live frames.
_REFUSED_PREFIXES = ("ctypes.", "sys.monitoring")
_SUBPROCESS_EVENTS = frozenset(
    {
        "os.fork",
        "os.forkpty",
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "subprocess.Popen",
        "pty.spawn",
    }
)
# Any component of a dotted name counts: an extension module loads under any package name.
# _posixshmem creates files in /dev/shm with no audit event; Tcl (_tkinter) opens files and
# runs commands of its own.
_REFUSED_MODULES = frozenset({"ctypes", "_posixshmem", "_tkinter"})
# Where the hook guards the filesystem: C code that writes files with no audit event
# (semaphores in /dev/shm, dbm files, readline history, SQLite's ATTACH, the system log).
_UNAUDITED_WRITERS = frozenset(
    {"_multiprocessing", "_dbm", "_gdbm", "readline", "_sqlite3", "syslog"}
)
# _ctypes and its test module; subinterpreters (no audit hooks there: _xxsubinterpreters,
# _interpreters); CPython's test modules (raw memory, interpreter internals).
_REFUSED_MODULE_PREFIXES = ("_ctypes", "_xx", "_interp", "_test")
# event -> (positions of paths that must stay inside the workdir, positions of dir_fd args)
_PATH_EVENTS = {
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


def _drop_privileges(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid):
        raise SystemExit("sandbox: could not drop privileges")


def _frozen(function: types.FunctionType, *defaults: object) -> types.FunctionType:
    """`function`'s code with `defaults` as its trailing positional defaults (a tuple, which
    cannot be changed) and no globals or builtins at all: a name it fails to take from its
    arguments raises, and every exception in the hook is a refusal."""
    return types.FunctionType(function.__code__, {"__builtins__": {}}, function.__name__, defaults)


# The hook's functions take their state as two tuples, unpacked the same way everywhere:
# policy = (refused events, refused event prefixes, (refused module names, name prefixes),
#           extension module directories, path events, work directory, write flags,
#           /proc/<pid> matcher, own /proc directory, own pid, kernel-confined,
#           the code objects of the hook's own functions)
# prims = (lstat, readlink, getcwd, type, str, bytes, bytes.decode, str.__str__, stat,
#          PermissionError, OSError, FunctionType)


def _text(path, prims):
    """A path given as str or bytes, as an exact str; anything else is refused."""
    _, _, _, type_, str_, bytes_, decode, _, _, refusal, _, _ = prims
    kind = type_(path)
    if kind is bytes_:
        return decode(path, "utf-8", "surrogateescape")
    if kind is not str_:  # a str subclass or path-like would run the program's code
        raise refusal("sandbox: a path must be a str, bytes or descriptor here")
    return path


def _resolve(path, prims, text):
    """Where `path` (a str, bytes or descriptor) leads, all links followed, computed from
    lstat and readlink alone (os.path.realpath is Python code the program could patch)."""
    lstat, readlink, getcwd, type_, str_, _, _, _, _, refusal, os_error, _ = prims
    if type_(path) is type_(0):
        return readlink("/proc/self/fd/" + str_(path))
    path = text(path, prims)
    if not path.startswith("/"):
        path = getcwd() + "/" + path
    resolved, pending, hops = "", path.split("/")[::-1], 0
    while pending:
        part = pending.pop()
        if part == "" or part == ".":
            continue
        if part == "..":
            resolved = resolved.rpartition("/")[0]
            continue
        candidate = resolved + "/" + part
        try:
            mode = lstat(candidate).st_mode
        except os_error:  # a name still to be created
            resolved = candidate
            continue
        if mode & 0o170000 != 0o120000:
            resolved = candidate
            continue
        hops += 1
        if hops > 40:
            raise refusal("sandbox: too many levels of links")
        target = readlink(candidate)
        if target.startswith("/"):
            resolved = ""
        pending += target.split("/")[::-1]
    return resolved or "/"


def _inside(resolved, root):
    return resolved == root or resolved.startswith(root + "/")


def _check_open(path, mode, flags, policy, prims, fns):
    text, resolve, inside = fns
    _, _, _, _, _, root, write_flags, other_proc, own_proc, _, _, _ = policy
    _, _, _, type_, _, _, _, _, stat, refusal, os_error, _ = prims
    if type_(path) is type_(0):  # wrapping a descriptor opened earlier (and checked then)
        return
    name = text(path, prims)
    if not name.startswith("/") and ".." in name.split("/"):
        # os.open's dir_fd is not in the event: "../.." could climb from another directory
        # than the current one, which the path is resolved against here.
        raise refusal("sandbox: a relative path with '..' is not allowed here")
    resolved = resolve(name, prims, text)
    writing = flags & write_flags or (
        mode is not None and ("w" in mode or "a" in mode or "x" in mode or "+" in mode)
    )
    if writing and not inside(resolved, root):
        raise refusal("sandbox: writing outside the work directory: " + resolved)
    if other_proc(resolved) and not resolved.startswith(own_proc):
        raise refusal("sandbox: other processes are off limits")
    if mode is None and not inside(resolved, root):
        # os.open of an outside directory would give a dir_fd that escapes the path checks
        try:
            is_dir = stat(resolved).st_mode & 0o170000 == 0o040000
        except os_error:
            is_dir = False
        if is_dir:
            raise refusal("sandbox: directory descriptors outside the work directory")


def _check_paths(event, args, policy, prims, fns):
    """A call that changes the filesystem: every path it names must lead inside the workdir."""
    text, resolve, inside = fns
    _, _, _, _, path_events, root, _, _, _, _, _, _ = policy
    _, _, _, type_, _, _, _, _, _, refusal, _, _ = prims
    paths, dir_fd_positions = path_events[event]
    dir_fds = ()
    for i in dir_fd_positions:
        # Without a dir_fd CPython reports None or a negative default (-1): the paths are
        # then relative to the current directory.
        if i < args.__len__() and args[i] is not None:
            if not (type_(args[i]) is type_(0) and args[i] < 0):
                dir_fds += (args[i],)
    for fd in dir_fds:  # shutil.rmtree works this way: a plain name in a directory inside
        if not inside(resolve(fd, prims, text), root):
            raise refusal("sandbox: " + event + " with this dir_fd is not allowed")
    for i in paths:
        if dir_fds:
            if "/" in text(args[i], prims):
                raise refusal("sandbox: " + event + " with a dir_fd takes a plain name")
        elif not inside(resolve(args[i], prims, text), root):
            raise refusal("sandbox: " + event + " outside the work directory")


def _check_import(args, policy, prims, fns):
    """Refuse ctypes (under any name) and extension modules from outside the standard
    library (a .so the program wrote, or another package's native code)."""
    text, resolve, _ = fns
    _, _, (refused_modules, refused_prefixes), dynload, _, _, _, _, _, _, _, _ = policy
    _, _, _, _, _, _, _, str_str, _, refusal, _, _ = prims
    name = str_str(args[0])  # the exact text the loader uses; a non-str raises: refused
    for part in name.split("."):
        if part in refused_modules or part.startswith(refused_prefixes):
            raise refusal("sandbox: importing " + name + " is not allowed")
    if args[1] is None:  # the import statement's own event; a loader's follows
        return
    location = resolve(str_str(args[1]), prims, text)
    if location.rpartition("/")[2].startswith(refused_prefixes) or not location.startswith(dynload):
        raise refusal("sandbox: loading " + location + " is not allowed")


def _audit_hook(event, args, policy, prims, fns, check_open, check_paths, check_import):
    refused, prefixes, _, _, path_events, _, _, _, _, own_pid, kernel_confined, own = policy
    _, _, _, type_, _, _, _, _, _, refusal, _, function_type = prims
    if event in refused or event.startswith(prefixes):
        raise refusal("sandbox: " + event + " is not allowed")
    if event == "object.__setattr__":
        # A traceback's frames hold the hook's helper functions: their code and defaults
        # stay theirs (only these function attributes raise this event).
        if type_(args[0]) is function_type and args[0].__code__ in own:
            raise refusal("sandbox: changing the audit hook is not allowed")
    elif event == "import":
        check_import(args, policy, prims, fns)
    elif event == "os.kill" or event == "resource.prlimit":
        if args[0] != own_pid and not (event == "resource.prlimit" and args[0] == 0):
            raise refusal("sandbox: " + event + " of other processes is not allowed")
    elif kernel_confined:  # the read-only root is the wall for writes; tempfile, unlink pass
        return
    elif event == "open":
        check_open(args[0], args[1], args[2], policy, prims, fns)
    elif event in path_events:
        check_paths(event, args, policy, prims, fns)


_HOOK_FUNCTIONS = (_text, _resolve, _inside, _check_open, _check_paths, _check_import, _audit_hook)


def _install_audit_hook(workdir: str, allow_subprocess: bool, kernel_confined: bool) -> None:
    dynload = tuple(
        os.path.realpath(p) + "/" for p in sys.path if os.path.basename(p) == "lib-dynload"
    )
    subprocess_events = frozenset() if allow_subprocess else _SUBPROCESS_EVENTS
    subprocess_modules = frozenset() if allow_subprocess else frozenset({"_posixsubprocess"})
    writer_modules = frozenset() if kernel_confined else _UNAUDITED_WRITERS
    policy = (
        _REFUSED_EVENTS | subprocess_events,
        _REFUSED_PREFIXES,
        (_REFUSED_MODULES | subprocess_modules | writer_modules, _REFUSED_MODULE_PREFIXES),
        dynload,
        types.MappingProxyType(dict(_PATH_EVENTS)),
        os.path.realpath(workdir),
        os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC,
        re.compile(r"/proc/\d+(/|$)").match,
        f"/proc/{os.getpid()}/",
        os.getpid(),
        kernel_confined,
        frozenset(f.__code__ for f in _HOOK_FUNCTIONS),
    )
    # C functions and builtin types, taken before the program can replace them anywhere.
    prims = (
        os.lstat,
        os.readlink,
        os.getcwd,
        type,
        str,
        bytes,
        bytes.decode,
        str.__str__,
        os.stat,
        PermissionError,
        OSError,
        types.FunctionType,
    )
    fns = (_frozen(_text), _frozen(_resolve), _frozen(_inside))
    checks = (_frozen(_check_open), _frozen(_check_paths), _frozen(_check_import))
    sys.addaudithook(_frozen(_audit_hook, policy, prims, fns, *checks))


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
