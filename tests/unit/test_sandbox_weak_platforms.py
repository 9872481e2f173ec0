"""The sandbox's second layer and the platforms docs/sandbox.md calls weak, under attack.

Each class of attack runs as several variants on the strongest platform here and on the weak
ones a test can force: the strongest without its memory cgroup (what a non-root worker with
user namespaces gets), without namespaces (root, the program under a fresh uid) and, for the
cleanup, without namespaces and without the syscall filter (an architecture it does not
know). One test runs the sandbox as `nobody` without namespaces: the worker and the program
are then the same user, and only the filter and the hook stand between them.
"""

from __future__ import annotations

import functools
import os
import shutil
import stat
import subprocess
import tempfile
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from groupflow.reward_workers import sandbox
from groupflow.reward_workers.sandbox import Limits, run_python
from groupflow.reward_workers.sandbox.host_workdir import remove_tree
from tests.unit.as_nobody import run_sandbox_as_nobody

SMALL = Limits(wall_s=5.0, cpu_s=5, memory_mb=128, max_processes=6, disk_mb=1)
IS_ROOT = os.geteuid() == 0


def _platform(kind: str) -> sandbox.SandboxPlatform:
    strongest = sandbox.default_platform()
    if kind == "strongest":
        return strongest
    if kind == "no-cgroup":
        return replace(strongest, memory_cgroup=None)
    if kind == "no-namespaces":
        return _no_namespaces()
    raise ValueError(kind)


@functools.cache
def _no_namespaces() -> sandbox.SandboxPlatform:
    return sandbox.probe_platform(namespaces=False)


@pytest.fixture(params=["strongest", "no-cgroup", "no-namespaces"])
def platform(request):
    return _platform(request.param)


def attempts(setup: str, tries: dict[str, str]) -> str:
    """A program that runs `setup`, then each attempt, printing DID or refused for each.
    Each attempt starts in a directory of its own in the work directory."""
    parts = [textwrap.dedent(setup), "import os as _os\n_start = _os.getcwd()\n"]
    for i, (name, code) in enumerate(tries.items()):
        body = textwrap.indent(textwrap.dedent(code).strip(), "    ")
        parts.append(
            f"_os.chdir(_start)\n_os.mkdir('attempt-{i}')\n_os.chdir('attempt-{i}')\n"
            f"try:\n{body}\n    print('DID', {name!r}, flush=True)\n"
            f"except BaseException as err:\n    print('refused', {name!r}, type(err).__name__)\n"
        )
    return "\n".join(parts)


def assert_all_refused(
    result: sandbox.SandboxResult, tries: dict[str, str], error: str | None = None
) -> None:
    """Every attempt failed (with `error`, the exception's type name, when given)."""
    assert "DID" not in result.stdout, result.stdout + result.stderr
    refused = {
        line.split()[1]
        for line in result.stdout.splitlines()
        if line.startswith("refused") and (error is None or line.split()[2] == error)
    }
    assert refused == set(tries), result.stdout + result.stderr


# --- the audit hook cannot be relaxed ---------------------------------------------------------

# Each tries to reach the hook's state and change or replace it, then the program checks that
# the hook still refuses a socket, a subprocess and (where it guards the filesystem) a write
# outside the work directory.
_MUTATE = """
import socket, sys, types, os, builtins
def mutate(frame):
    # the sandbox's own frames (its bootstrap runs as `python -c`: '<string>')
    while frame is not None:
        if frame.f_code.co_filename == '<string>':
            for scope in (frame.f_locals, frame.f_globals):
                for key, value in list(scope.items()):
                    if value is vars(builtins) or value is sys.modules:
                        continue  # the program would break itself, not the hook
                    for action in ('clear',):
                        try:
                            getattr(value, action)()
                        except Exception:
                            pass
                    if isinstance(value, types.FunctionType):
                        try:
                            value.__code__ = (lambda *a, **k: None).__code__
                        except Exception:
                            pass
                    try:
                        scope[key] = None
                    except Exception:
                        pass
        frame = frame.f_back
def frames_of(err):
    tb = err.__traceback__
    while tb is not None:
        yield tb.tb_frame
        tb = tb.tb_next
def refused_socket():
    try:
        socket.socket()
    except PermissionError as err:
        return err
"""

HOOK_RELAXATIONS = {
    "traceback-frames": "for frame in frames_of(refused_socket()): mutate(frame)",
    "traceback-f-locals-rewrite": """
        for frame in frames_of(refused_socket()):
            for key in list(frame.f_locals):
                frame.f_locals[key] = frozenset()
    """,
    "generator-frame": """
        def gen():
            err = refused_socket()
            yield err
            yield sys._getframe()
        g = gen()
        for frame in frames_of(next(g)): mutate(frame)
        mutate(g.gi_frame)
        mutate(next(g))
    """,
    "gc-referrers": """
        import gc
        for obj in gc.get_referrers(sys.addaudithook) + gc.get_objects():
            if isinstance(obj, (set, dict, list)): obj.clear()
    """,
    "main-module-globals": """
        main = sys.modules['__main__']
        for name, value in list(vars(main).items()):
            if isinstance(value, types.FunctionType):
                value.__code__ = (lambda *a, **k: None).__code__
            elif isinstance(value, dict):
                value.clear()
            elif isinstance(value, (frozenset, tuple)):
                setattr(main, name, type(value)())
    """,
    "patched-os-and-builtins": """
        os.path.realpath = lambda path, **kw: os.getcwd() + '/inside'
        os.readlink = lambda *a, **k: os.getcwd()
        real_lstat = os.lstat
        os.lstat = os.stat = lambda *a, **k: real_lstat(os.getcwd())
        os.getpid = lambda: 1
        builtins.str = lambda *a: 'harmless'
        builtins.isinstance = lambda *a: False
        builtins.PermissionError = type('Harmless', (Warning,), {})
    """,
    "str-subclass-event-args": """
        class Sly(str):
            def __str__(self): return 'harmless'
            def split(self, *a): return ['harmless']
            def startswith(self, *a): return False
            def __eq__(self, other): return False
            __hash__ = str.__hash__
        import importlib.machinery, importlib.util
        path = Sly('/nonexistent/_ctypes.so')
        importlib.util.module_from_spec(importlib.util.spec_from_file_location(
            Sly('_ctypes'), path, loader=importlib.machinery.ExtensionFileLoader(Sly('_ctypes'), path)))
    """,
    "sys-monitoring": """
        if hasattr(sys, 'monitoring'):
            sys.monitoring.use_tool_id(3, 'x')
            sys.monitoring.register_callback(3, 1, lambda *a: mutate(sys._getframe(1)))
        else:
            sys.setprofile(lambda frame, *a: mutate(frame))
    """,
}


@pytest.mark.parametrize("relaxation", list(HOOK_RELAXATIONS))
def test_the_audit_hook_cannot_be_relaxed(relaxation, platform, tmp_path):
    outside = tmp_path / "escape.txt"
    checks = {
        "socket": "socket.socket()",
        "subprocess": "os.system('true')",
        "ctypes": "import ctypes",
    }
    if "minimal-root" not in platform.isolation:  # the hook guards the filesystem here
        checks["write-outside"] = f"open({str(outside)!r}, 'w').write('x')"
    relax = textwrap.indent(textwrap.dedent(HOOK_RELAXATIONS[relaxation]).strip(), "    ")
    setup = f"{_MUTATE}\ntry:\n{relax}\nexcept BaseException:\n    pass\n"
    result = run_python(attempts(setup, checks), SMALL, platform=platform)
    assert_all_refused(result, checks, "PermissionError")
    assert not outside.exists()


ORDINARY_PROGRAM = """
import collections, dataclasses, functools, logging, pathlib, tempfile, traceback, typing
Point = collections.namedtuple('Point', 'x y', defaults=(0,))
def f(a=1):
    return a
f.__defaults__ = (2,)
@dataclasses.dataclass
class Box:
    size: int = 3
try:
    raise ValueError('shown')
except ValueError:
    shown = traceback.format_exc().count('shown')
logging.getLogger('x').warning('logged')
with tempfile.TemporaryDirectory() as d:
    open(d + '/f', 'w').write('x')
print(Point(1).y, f(), Box().size, shown, typing.get_type_hints(Box)['size'].__name__,
      pathlib.Path('.').resolve() == pathlib.Path.cwd())
"""


def test_ordinary_programs_still_run(platform):
    # Reaching the hook's state is refused; what the standard library does to its own
    # functions, frames and tracebacks is not.
    result = run_python(ORDINARY_PROGRAM, SMALL, platform=platform)
    assert result.stdout == "0 2 3 1 int True\n", result.stderr


def test_the_hook_reads_no_global_or_builtin_name():
    """Its code and helpers take everything from their arguments (see sandbox/child.py)."""
    import dis

    source = (Path(sandbox.__file__).parent / "child.py").read_text()
    module = compile(source, "child.py", "exec")
    names = {"_text", "_resolve", "_inside", "_check_open", "_check_paths", "_check_import"}
    names.add("_audit_hook")
    codes = [c for c in module.co_consts if getattr(c, "co_name", None) in names]
    assert {c.co_name for c in codes} == names
    for code in codes:
        assert code.co_freevars == () and code.co_cellvars == (), code.co_name
        loads = {i.opname for i in dis.get_instructions(code)}
        assert not loads & {"LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "STORE_GLOBAL"}, code.co_name


# --- writes outside the work directory ----------------------------------------------------------

OUTSIDE_WRITES = {
    "fifo-in-tmp": "os.mkfifo({tmp!r} + '/fifo')",
    "node-in-tmp": "os.mknod({tmp!r} + '/node')",
    "patched-realpath": """
        os.path.realpath = lambda p, **k: os.getcwd() + '/x'
        open({tmp!r} + '/patched', 'w').write('x')
    """,
    "str-subclass-path": """
        class Sly(str):
            def __str__(self): return 'inside'
            def __fspath__(self): return 'inside'
        open(Sly({tmp!r} + '/sly'), 'w').write('x')
    """,
    "flipping-path-like": """
        class Flip:
            calls = 0
            def __fspath__(self):
                Flip.calls += 1
                return {tmp!r} + '/flip' if Flip.calls % 2 else 'inside'
        open(Flip(), 'w').write('x')
    """,
    "bytes-path-dotdot": (
        "open(os.getcwd().encode() + b'/..' * os.getcwd().count('/') + {tmp!r}.encode() + b'/b', 'w')"
    ),
    "posix-shm": "import _posixshmem; _posixshmem.shm_open('/gf-test-escape', os.O_CREAT | os.O_RDWR, 0o600)",
    "dev-shm": "open('/dev/shm/gf-test-escape', 'w').write('x')",
    "hard-link-out": "open('a', 'w').close(); os.link('a', {tmp!r} + '/hard')",
    "sqlite": "import sqlite3; sqlite3.connect({tmp!r} + '/db').execute('create table t(x)')",
    "symlink-then-write": "os.symlink({tmp!r}, 'out'); open('out/via-link', 'w').write('x')",
    "dir-fd-climb": """
        work = os.getcwd()
        os.makedirs('a/b/c/d/e/f/g/h')
        os.chdir('a/b/c/d/e/f/g/h')
        fd = os.open(work, os.O_RDONLY)
        climb = '../' * work.count('/') + {tmp!r}[1:] + '/climbed'
        os.close(os.open(climb, os.O_WRONLY | os.O_CREAT, dir_fd=fd))
    """,
    "rename-workdir-away": "os.rename(_start, _start + '-moved')",
    # C code that writes files with no audit event
    "semaphore": "import _multiprocessing; _multiprocessing.SemLock(1, 1, 1, '/gf-test-sem', False)",
    "dbm": "import _dbm; _dbm.open({tmp!r} + '/dbm', 'c')",
    "readline-history": "import readline; readline.write_history_file({tmp!r} + '/history')",
    "sqlite-attach": (
        "import sqlite3\n"
        "db = sqlite3.connect(':memory:')\n"
        "db.execute('attach database ? as outside', ({tmp!r} + '/attached',))\n"
        "db.execute('create table outside.t(x)')"
    ),
    "tcl": "import _tkinter; _tkinter.create(None, 'x', 'Tk', 0, 0, 0, 0).eval('close [open {tmp}/tcl w]')",
}


@pytest.fixture
def writable_outside():
    """A world-writable directory outside the sandbox (a sandbox uid could write it)."""
    path = Path(tempfile.mkdtemp(prefix="gf-outside-"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path)


def test_writes_outside_the_work_directory_are_refused(platform, writable_outside):
    tries = {k: v.format(tmp=str(writable_outside)) for k, v in OUTSIDE_WRITES.items()}
    result = run_python(attempts("import os", tries), SMALL, platform=platform)
    assert_all_refused(result, tries)
    assert list(writable_outside.iterdir()) == []
    assert not os.path.exists("/dev/shm/gf-test-escape")
    assert not os.path.exists("/dev/shm/sem.gf-test-sem")


# --- the cleanup follows no link ------------------------------------------------------------


@pytest.fixture
def victim_dir():
    """A host directory whose mode and contents must survive any sandbox's cleanup."""
    path = Path(tempfile.mkdtemp(prefix="gf-victim-"))
    (path / "sub").mkdir()
    (path / "keep.txt").write_text("keep")
    path.chmod(0o755)
    (path / "sub").chmod(0o755)
    yield path
    shutil.rmtree(path)


def _intact(victim: Path) -> bool:
    return (
        stat.S_IMODE(victim.stat().st_mode) == 0o755
        and stat.S_IMODE((victim / "sub").stat().st_mode) == 0o755
        and (victim / "keep.txt").read_text() == "keep"
    )


def test_cleanup_removes_planted_links_without_following_them(tmp_path, victim_dir):
    tree = tmp_path / "gf-sandbox-x"
    (tree / "work" / "locked" / "deeper").mkdir(parents=True)
    (tree / "work" / "to-dir").symlink_to(victim_dir)
    (tree / "work" / "to-sub").symlink_to(victim_dir / "sub")
    (tree / "work" / "locked" / "to-dir").symlink_to(victim_dir)
    (tree / "work" / "locked" / "deeper" / "f").write_text("x")
    os.mkfifo(tree / "work" / "fifo")
    (tree / "work" / "locked" / "deeper").chmod(0)
    (tree / "work" / "locked").chmod(0)
    remove_tree(str(tree))
    assert not tree.exists()
    assert _intact(victim_dir)


def test_cleanup_of_a_work_directory_replaced_by_a_link(tmp_path, victim_dir):
    tree = tmp_path / "gf-sandbox-x"
    tree.symlink_to(victim_dir)
    remove_tree(str(tree))
    assert _intact(victim_dir)


@pytest.mark.skipif(not IS_ROOT, reason="a hookless helper plants the links as the sandbox uid")
@pytest.mark.parametrize("syscall_filter", [True, False])
def test_links_planted_by_a_hookless_process_are_not_followed(victim_dir, syscall_filter):
    weak = replace(_no_namespaces(), syscall_filter=syscall_filter)
    inner = textwrap.dedent(
        f"""
        import os
        def plant(target, name):
            try:
                os.symlink(target, name)
            except OSError:  # refused by the syscall filter where there is one
                pass
        plant({str(victim_dir)!r}, 'to-dir')
        plant({str(victim_dir / "sub")!r}, 'to-sub')
        os.mkdir('locked')
        plant({str(victim_dir)!r}, 'locked/to-dir')
        os.chmod('locked', 0)
        try:
            os.rename(os.getcwd(), os.getcwd() + '-moved')
            print('MOVED')
        except OSError:
            print('stayed')
        """
    )
    program = (
        f"import subprocess, sys\nsubprocess.run([sys.executable, '-I', '-S', '-c', {inner!r}])\n"
    )
    result = run_python(program, SMALL, allow_subprocess=True, platform=weak)
    assert result.stdout == "stayed\n", result.stdout + result.stderr
    assert _intact(victim_dir)


# --- ctypes, under any name -----------------------------------------------------------------

_CTYPES_SETUP = """
import importlib, importlib.machinery, importlib.util, os, shutil, sys, glob
real = (glob.glob(os.path.join(os.path.dirname(os.__file__), 'lib-dynload', '_ctypes*.so'))
        or ['/nonexistent/_ctypes.so'])[0]
def load(name, path):
    spec = importlib.util.spec_from_file_location(
        name, path, loader=importlib.machinery.ExtensionFileLoader(name, path))
    importlib.util.module_from_spec(spec)  # runs the library's initialisation
class Sly(str):
    def __str__(self): return 'harmless'
    def split(self, *a): return ['harmless']
    def startswith(self, *a): return False
"""

CTYPES_ROUTES = {
    "import": "import ctypes",
    "import-module": "importlib.import_module('_ctypes')",
    "dunder-import": "__import__('ctypes.util')",
    "loader-real-name": "load('_ctypes', real)",
    "loader-in-package": "load('harmless._ctypes', real)",
    "copy-renamed": "shutil.copy(real, 'lib.so'); load('_ctypes', os.path.abspath('lib.so'))",
    "str-subclass-name": "load(Sly('_ctypes'), Sly(real))",
    "copy-of-stdlib-module": (
        "src = glob.glob(os.path.join(os.path.dirname(os.__file__), 'lib-dynload', '_json*.so'))[0]\n"
        "shutil.copy(src, '_json.so'); load('_json', os.path.abspath('_json.so'))"
    ),
    "sys-modules": "sys.modules['_ctypes'].dlopen",
    "ctypes-test-module": "import _ctypes_test",
}

# Code that would run without this interpreter's audit hook, or reach its internals.
HOOKLESS_INTERPRETERS = {
    "subinterpreter": "import _xxsubinterpreters as i; i.run_string(i.create(), 'pass')",
    "subinterpreter-3.13": "import _interpreters as i; i.run_string(i.create(), 'pass')",
    "subinterpreter-by-loader": (
        "import importlib.util\n"
        "importlib.util.module_from_spec(importlib.util.find_spec('_xxsubinterpreters'))"
    ),
    "testcapi": "import _testcapi",
    "testinternalcapi": "import _testinternalcapi",
}


def test_no_code_runs_without_the_hook(platform):
    result = run_python(attempts("", HOOKLESS_INTERPRETERS), SMALL, platform=platform)
    assert_all_refused(result, HOOKLESS_INTERPRETERS)


def test_ctypes_cannot_be_loaded_under_any_name(platform):
    result = run_python(attempts(_CTYPES_SETUP, CTYPES_ROUTES), SMALL, platform=platform)
    assert_all_refused(result, CTYPES_ROUTES)


# --- memory past the limits -----------------------------------------------------------------

# Each would give the program memory that RLIMIT_AS does not count (memfds, shared memory):
# without a memory cgroup nothing would bound it, so creating one at all must fail.
MEMORY_ROUTES = {
    "memfd": "fd = os.memfd_create('x')",
    "fresh-posix-memfd": (
        "import importlib.util\n"
        "fd = importlib.util.module_from_spec(importlib.util.find_spec('posix')).memfd_create('x')"
    ),
    "posix-shm": "import _posixshmem; fd = _posixshmem.shm_open('/gf-test-mem', os.O_CREAT | os.O_RDWR, 0o600)",
    "shared-memory": (
        "from multiprocessing import shared_memory\n"
        "fd = shared_memory.SharedMemory(create=True, size=1 << 26)._fd"
    ),
    "dev-shm": "fd = os.open('/dev/shm/gf-test-mem', os.O_CREAT | os.O_RDWR)",
}


def test_memory_outside_the_address_space_limit_is_refused(platform):
    program = attempts("import os", MEMORY_ROUTES)
    result = run_python(program, SMALL, platform=platform)
    assert_all_refused(result, MEMORY_ROUTES)
    assert not os.path.exists("/dev/shm/gf-test-mem")


# --- signals to the parent and other processes ----------------------------------------------


def _signal_routes(target: int | str, group: int | str) -> dict[str, str]:
    # Signal 0 asks whether a signal would be delivered, without harming the test runner.
    return {
        "kill": f"os.kill({target}, 0)",
        "kill-parent": "assert os.getppid() > 1; os.kill(os.getppid(), 0)",
        "killpg": f"os.killpg({group}, 0)",
        "kill-all": "os.kill(-1, 0)",
        "pidfd": f"signal.pidfd_send_signal(os.pidfd_open({target}), 0)",
        "pidfd-parent": "signal.pidfd_send_signal(os.pidfd_open(os.getppid()), 0)",
        "prlimit": f"import resource; resource.prlimit({target}, resource.RLIMIT_NOFILE, (1, 1))",
        "renice": f"os.setpriority(os.PRIO_PROCESS, {target}, 19)",
        "affinity": f"os.sched_setaffinity({target}, {{0}})",
        "fresh-posix-kill": (
            "import importlib.util\n"
            "importlib.util.module_from_spec(importlib.util.find_spec('posix'))"
            f".kill({target}, 0)"
        ),
    }


def test_signals_cannot_reach_the_worker_or_other_processes(platform):
    victim = subprocess.Popen(["sleep", "30"])
    try:
        tries = _signal_routes(victim.pid, os.getpgid(0))
        result = run_python(attempts("import os, signal", tries), SMALL, platform=platform)
        assert_all_refused(result, tries)
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_a_non_root_worker_without_namespaces_cannot_be_signalled():
    """The worker and the program are the same user here: the kernel's uid check does not
    apply, so the syscall filter and the hook must refuse every route (round 1: a pidfd)."""
    # WORKER and GROUP: run.py, the program's parent, and its process group
    routes = _signal_routes("WORKER", "GROUP")
    report = run_sandbox_as_nobody(
        "p = sandbox.probe_platform(namespaces=False)\n"
        f"program = {attempts('import os, signal', routes)!r}\n"
        "program = program.replace('WORKER', str(os.getpid()))"
        ".replace('GROUP', str(os.getpgid(0)))\n"
        "r = sandbox.run_python(program, sandbox.Limits(wall_s=5, cpu_s=5))\n"
        "print(json.dumps({'isolation': p.isolation, 'out': r.stdout, 'err': r.stderr, "
        "'alive': os.getpid()}))\n",
        timeout=60,
    )
    assert "unprivileged-uid" not in report["isolation"]
    assert "syscall-filter" in report["isolation"]
    result = sandbox.SandboxResult(0, report["out"], report["err"], False)
    assert_all_refused(result, routes)


def test_a_program_may_still_signal_and_limit_itself(platform):
    program = (
        "import os, resource, signal, threading\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))\n"
        "resource.prlimit(os.getpid(), resource.RLIMIT_CORE, (0, 0))\n"
        "os.kill(os.getpid(), 0)\n"
        "signal.pthread_kill(threading.get_ident(), 0)\n"
        "signal.signal(signal.SIGUSR1, lambda *a: print('ok'))\n"
        "signal.raise_signal(signal.SIGUSR1)\n"
    )
    result = run_python(program, SMALL, platform=platform)
    assert result.stdout == "ok\n", result.stderr


def test_weak_platforms_say_what_they_lack():
    assert {"minimal-root", "ipc-namespace", "memory-cgroup"} <= set(_no_namespaces().missing)
    assert "memory-cgroup" in _platform("no-cgroup").missing
    if os.uname().machine in ("x86_64", "aarch64"):
        assert "syscall-filter" in _no_namespaces().isolation
        assert "syscall-filter" in sandbox.default_platform().isolation
