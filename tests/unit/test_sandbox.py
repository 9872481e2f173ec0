"""The sandbox against hostile programs: each is contained, and nothing outside is harmed.

Every test runs on both the strongest platform this machine offers (namespaces when
`unshare` works) and the fallback without namespaces. Limits and timeouts are tiny.
Tests that rely on running as a separate uid skip when the tests do not run as root.
"""

import os
import signal
import socket
import subprocess
import time

import pytest

from groupflow.reward_workers.sandbox import Limits, default_platform, probe_platform, run_python
from groupflow.reward_workers.sandbox.run import _fresh_id

SMALL = Limits(wall_s=5.0, cpu_s=5, memory_mb=256, max_processes=6, disk_mb=1)
IS_ROOT = os.geteuid() == 0


@pytest.fixture(scope="module", params=["strongest", "no-namespaces"])
def platform(request):
    return default_platform() if request.param == "strongest" else probe_platform(namespaces=False)


def sandbox_processes() -> list[int]:
    """Live processes running as a sandbox uid (drawn from 1_000_000 up). Zombies are dead
    already; reaping them is the job of whichever init inherited them."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/status") as f:
                    status = dict(line.split(":", 1) for line in f if ":" in line)
            except OSError:
                continue
            if int(status["Uid"].split()[0]) >= 1_000_000 and not status[
                "State"
            ].strip().startswith("Z"):
                found.append(int(entry.name))
    return found


def surviving_sandbox_processes(within_s: float = 2.0) -> list[int]:
    """Sandbox processes still alive after within_s (SIGKILL takes effect asynchronously)."""
    deadline = time.monotonic() + within_s
    while (found := sandbox_processes()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def test_runs_a_program(platform):
    result = run_python(
        "import sys\nprint('out', 6 * 7)\nprint('err', file=sys.stderr)", SMALL, platform=platform
    )
    assert result == result.__class__(
        returncode=0, stdout="out 42\n", stderr="err\n", timed_out=False
    )


def test_work_directory_is_private_and_writable(platform):
    program = "import os\nopen('f.txt', 'w').write('hi')\nprint(os.getcwd() == os.environ['HOME'], open('f.txt').read())"
    result = run_python(program, SMALL, platform=platform)
    assert result.stdout == "True hi\n"


def test_platform_reports_its_layers(platform):
    assert {"rlimits", "session", "clean-env", "audit-hook"} <= set(platform.isolation)
    assert ("unprivileged-uid" in platform.isolation) == IS_ROOT


def test_infinite_loop_is_stopped_by_the_wall_clock(platform):
    start = time.monotonic()
    result = run_python("while True:\n    pass", Limits(wall_s=0.5, cpu_s=10), platform=platform)
    assert result.timed_out
    assert result.returncode == -signal.SIGKILL
    assert time.monotonic() - start < 3


def test_cpu_limit_kills_a_busy_program(platform):
    start = time.monotonic()
    result = run_python("while True:\n    pass", Limits(wall_s=20, cpu_s=1), platform=platform)
    assert not result.timed_out
    assert result.returncode in (-signal.SIGXCPU, -signal.SIGKILL)
    assert time.monotonic() - start < 10


def test_memory_hog_gets_memory_error(platform):
    program = "x = bytearray(1024 ** 3)\nprint('allocated')"
    result = run_python(program, Limits(memory_mb=128), platform=platform)
    assert result.returncode == 1
    assert "MemoryError" in result.stderr
    assert "allocated" not in result.stdout


def test_large_file_is_cut_off(platform):
    result = run_python(
        "open('big', 'wb').write(b'x' * (2 * 1024 * 1024))", SMALL, platform=platform
    )
    assert result.returncode == 1
    assert "File too large" in result.stderr or "No space left" in result.stderr


def test_output_flood_is_bounded(platform):
    result = run_python(
        "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)",
        Limits(disk_mb=1, output_bytes=4096),
        platform=platform,
    )
    assert result.returncode != 0
    assert len(result.stdout) == 4096


def test_fork_bomb_is_refused(platform):
    start = time.monotonic()
    result = run_python("import os\nwhile True:\n    os.fork()", SMALL, platform=platform)
    assert result.returncode == 1
    assert "os.fork is not allowed" in result.stderr
    assert time.monotonic() - start < 3


@pytest.mark.skipif(
    not IS_ROOT, reason="RLIMIT_NPROC is exact only with a uid of the sandbox's own"
)
def test_fork_bomb_with_subprocesses_allowed_hits_the_process_limit(platform):
    bomb = (
        "import os\n"
        "while True:\n"
        "    try:\n"
        "        os.fork()\n"
        "    except OSError as err:\n"
        "        print('limited', err.errno, flush=True)\n"
        "        while True:\n"
        "            pass\n"
    )
    start = time.monotonic()
    result = run_python(
        bomb, Limits(wall_s=1.5, cpu_s=5, max_processes=5), allow_subprocess=True, platform=platform
    )
    assert result.timed_out
    assert "limited 11" in result.stdout  # EAGAIN from RLIMIT_NPROC
    assert time.monotonic() - start < 5
    assert surviving_sandbox_processes() == []


@pytest.mark.skipif(not IS_ROOT, reason="finding leftovers relies on the sandbox's own uid")
def test_a_process_that_escapes_the_session_is_killed_too(platform):
    program = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')"
    result = run_python(program, SMALL, allow_subprocess=True, platform=platform)
    assert result.stdout == "parent done\n"
    assert surviving_sandbox_processes() == []


def test_writes_outside_the_work_directory_are_refused(platform, tmp_path):
    target = tmp_path / "escape.txt"
    attempts = [
        f"open({str(target)!r}, 'w').write('x')",
        "open('../escape.txt', 'w').write('x')",
        "open('/tmp/escape.txt', 'a').write('x')",
        f"os.close(os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT))",
        f"os.mkdir({str(tmp_path / 'escape_dir')!r})",
        "os.symlink('/', 'root_link')",
        "open('inside.txt', 'w').write('x'); os.rename('inside.txt', '../moved.txt')",
        "fd = os.open('/', os.O_RDONLY); os.open('escape.txt', os.O_WRONLY | os.O_CREAT, dir_fd=fd)",
        "os.chdir('/tmp'); open('escape.txt', 'w').write('x')",
        "import shutil; open('a', 'w').write('x'); shutil.copy('a', '/tmp/escape.txt')",
    ]
    program = "import os\n" + "".join(
        f"try:\n    {a}\n    print('WROTE', {i})\nexcept OSError as e:\n    print('blocked', {i}, type(e).__name__)\n"
        for i, a in enumerate(attempts)
    )
    result = run_python(program, SMALL, platform=platform)
    assert result.returncode == 0, result.stderr
    assert "WROTE" not in result.stdout
    assert result.stdout.count("blocked") == len(attempts)
    assert list(tmp_path.iterdir()) == []
    assert not os.path.exists("/tmp/escape.txt")


@pytest.mark.skipif(not IS_ROOT, reason="the kernel-side barrier is the separate uid")
def test_hookless_subprocess_cannot_write_outside_either(platform, tmp_path):
    # A subprocess has no audit hook: the uid (and the read-only root) must stop it.
    target = tmp_path / "escape.txt"
    inner = f"open({str(target)!r}, 'w').write('x')"
    program = f"import subprocess, sys\nsubprocess.run([sys.executable, '-I', '-S', '-c', {inner!r}])\nprint('ran')"
    result = run_python(program, SMALL, allow_subprocess=True, platform=platform)
    assert result.stdout == "ran\n"
    assert not target.exists()


@pytest.fixture
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.3)
    yield server
    server.close()


def _assert_no_connection(server):
    with pytest.raises(TimeoutError):
        server.accept()


def test_sockets_are_refused(platform, listener):
    port = listener.getsockname()[1]
    attempts = [
        f"socket.create_connection(('127.0.0.1', {port}), timeout=1)",
        "socket.socket(socket.AF_INET, socket.SOCK_DGRAM)",
        "socket.socket(socket.AF_UNIX)",
        "socket.getaddrinfo('example.com', 80)",
    ]
    program = "import socket\n" + "".join(
        f"try:\n    {a}\n    print('CONNECTED')\nexcept OSError as e:\n    print('blocked', type(e).__name__)\n"
        for a in attempts
    )
    result = run_python(program, SMALL, platform=platform)
    assert "CONNECTED" not in result.stdout
    assert result.stdout.count("blocked PermissionError") == len(attempts)
    _assert_no_connection(listener)


def test_subprocess_without_the_hook_has_no_network(listener):
    platform = default_platform()
    if "net-namespace" not in platform.isolation:
        pytest.skip("no network namespace here: only the audit hook blocks sockets")
    port = listener.getsockname()[1]
    inner = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1); print('CONNECTED')"
    program = (
        f"import subprocess, sys\nsubprocess.run([sys.executable, '-I', '-S', '-c', {inner!r}])"
    )
    result = run_python(program, SMALL, allow_subprocess=True, platform=platform)
    assert "CONNECTED" not in result.stdout
    assert "OSError" in result.stderr or "unreachable" in result.stderr
    _assert_no_connection(listener)


def test_environment_secrets_do_not_leak(platform, monkeypatch):
    monkeypatch.setenv("GROUPFLOW_TEST_SECRET", "hunter2-secret")
    program = (
        "import os\n"
        "print(sorted(os.environ))\n"
        f"for path in ['/proc/{os.getpid()}/environ', '/proc/1/environ', '/proc/self/environ']:\n"
        "    try:\n"
        "        print(open(path, 'rb').read())\n"
        "    except OSError as e:\n"
        "        print('blocked', path)\n"
    )
    result = run_python(program, SMALL, platform=platform)
    assert result.returncode == 0, result.stderr
    assert "hunter2" not in result.stdout + result.stderr
    assert result.stdout.splitlines()[0] in (
        "['HOME', 'LANG', 'PATH', 'TMPDIR']",
        "['HOME', 'LANG', 'PATH', 'PWD', 'TMPDIR']",
    )
    assert f"blocked /proc/{os.getpid()}/environ" in result.stdout


def test_cannot_kill_its_parent_or_other_processes(platform):
    victim = subprocess.Popen(["sleep", "30"])
    try:
        program = (
            "import os, signal\n"
            f"for pid in ({victim.pid}, {os.getpid()}, os.getppid(), 1, -1):\n"
            "    try:\n"
            "        os.kill(pid, signal.SIGKILL)\n"
            "        print('KILLED', pid)\n"
            "    except OSError as e:\n"
            "        print('blocked', pid)\n"
            "try:\n"
            f"    os.killpg({os.getpgid(0)}, signal.SIGKILL)\n"
            "except OSError:\n"
            "    print('blocked killpg')\n"
        )
        result = run_python(program, SMALL, platform=platform)
        assert "KILLED" not in result.stdout
        assert result.stdout.count("blocked") == 6
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.skipif(not IS_ROOT, reason="the kernel-side barrier is the separate uid")
def test_hookless_kill_cannot_reach_the_parent(platform):
    victim = subprocess.Popen(["sleep", "30"])
    try:
        inner = f"import os\nfor pid in ({victim.pid}, {os.getpid()}):\n    try:\n        os.kill(pid, 9)\n    except OSError:\n        pass"
        program = f"import subprocess, sys\nsubprocess.run([sys.executable, '-I', '-S', '-c', {inner!r}])\nprint('ran')"
        result = run_python(program, SMALL, allow_subprocess=True, platform=platform)
        assert result.stdout == "ran\n"
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.parametrize(
    "attempt",
    [
        "import ctypes",
        "import gc; gc.get_objects()",
        "import sys; sys.settrace(lambda *a: None)",
        "(lambda: 0).__code__.replace(co_code=b'')",
        "import _posixsubprocess",
        "import os; os.system('true')",
    ],
)
def test_escape_hatches_from_the_audit_hook_are_refused(attempt):
    result = run_python(f"{attempt}\nprint('ESCAPED')", SMALL)
    assert result.returncode == 1
    assert "ESCAPED" not in result.stdout
    assert "PermissionError: sandbox:" in result.stderr


@pytest.mark.parametrize(
    ("id_map", "low", "high"),
    [
        ("0 0 4294967295\n", 1_000_000, 2_000_000_000),  # the whole id space
        ("0 1000 1\n1 100000 65536\n", 10_000, 65_537),  # a rootless container
        ("0 0 1\n", 65534, 65535),  # only root mapped: nobody
    ],
)
def test_fresh_ids_come_from_mapped_ranges(tmp_path, id_map, low, high):
    path = tmp_path / "uid_map"
    path.write_text(id_map)
    ids = {_fresh_id(str(path)) for _ in range(20)}
    assert all(low <= i < high for i in ids)
    assert len(ids) > 1 or low == 65534
