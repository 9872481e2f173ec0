"""Hostile responses, plugins and inputs against the reward side, one test per class of attack.

Each runs on the real sandbox and scorer processes and checks the verdict, that the time
taken stays within the configured timeout plus a loose margin (the machine is shared), and
that nothing is left on the host: files in /tmp, processes, System V IPC objects, cgroups.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from groupflow.core.records import Prompt, Verdict
from groupflow.reward_workers import sandbox
from groupflow.reward_workers.datasets import load_prompts
from groupflow.reward_workers.sandbox import probe as sandbox_probe
from groupflow.reward_workers.score_cli import main as score_main
from groupflow.reward_workers.scorer import Scorer
from groupflow.reward_workers.tasks import code_problems, make_task
from groupflow.reward_workers.tasks.code_problems import CodeTask
from groupflow.reward_workers.tasks.math_problems import MathTask
from groupflow.run.job_config import build_config
from tests.unit.as_nobody import run_sandbox_as_nobody

IS_ROOT = os.geteuid() == 0
SLACK_S = 10.0  # on top of a timeout: process start-up on a busy shared machine
SMALL = sandbox.Limits(wall_s=5.0, cpu_s=5, memory_mb=256, max_processes=6, disk_mb=4)


def _ipc_objects() -> str:
    out = subprocess.run(["ipcs"], capture_output=True, text=True).stdout
    return "\n".join(line for line in out.splitlines() if line[:2] == "0x")


def _tmp_entries() -> set[str]:
    # What the reward side could leave: work directories (gf-sandbox-*); /tmp is shared with
    # other test runs on this machine (a Ray head's gf-head-*), so other names are not ours.
    return {p for p in os.listdir("/tmp") if p.startswith("gf-sandbox-")}


def _cgroups() -> set[str]:
    base = sandbox.default_platform().memory_cgroup
    return {p for p in os.listdir(base) if p.startswith("gf-")} if base else set()


def _descendants() -> set[int]:
    """Live processes below this one (zombies are dead already)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                fields = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


@pytest.fixture
def nothing_left_behind():
    before = (_tmp_entries(), _ipc_objects(), _cgroups(), _descendants())
    yield
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        after = (_tmp_entries(), _ipc_objects(), _cgroups(), _descendants())
        if all(
            a <= b if isinstance(a, set) else a == b for a, b in zip(after, before, strict=True)
        ):
            return
        time.sleep(0.1)
    assert after[0] <= before[0], f"files left in /tmp: {after[0] - before[0]}"
    assert after[1] == before[1], "System V IPC objects left behind"
    assert after[2] <= before[2], f"cgroups left behind: {after[2] - before[2]}"
    assert after[3] <= before[3], f"processes left running: {after[3] - before[3]}"


def _timed(fn, *args):
    start = time.monotonic()
    result = fn(*args)
    return result, time.monotonic() - start


def score_one(scorer: Scorer, prompt: Prompt, response: str) -> Verdict:
    return next(scorer.score_stream([(prompt, response)]))


# --- deadlines -----------------------------------------------------------------------------

RUNAWAY_MATH = [
    r"\boxed{((1000^{1000})^{1000})^{1000}}",
    r"\boxed{9^{9^{9^{9}}}}",
    r"\boxed{(10^{10})!}",
    r"\boxed{2^{2^{2^{2^{2^{2}}}}}}",
    r"\boxed{\frac{10^{100000}!}{3}}",
    r"\boxed{{{{{{{{{{{{{{{{{{{{1}}}}}}}}}}}}}}}}}}}}",
]
HANGING_PLUGIN = """
import asyncio, re, time
def regex(prompt, response, answer):
    return float(re.match(r'(a+)+$', response) is not None)
def sleeps(prompt, response, answer):
    time.sleep(60)
def busy_c(prompt, response, answer):
    return float(sum(range(10**11)) > 0)
async def blocks_loop(prompt, response, answer):
    time.sleep(60)
async def awaits_forever(prompt, response, answer):
    await asyncio.sleep(3600)
def ignores_signals(prompt, response, answer):
    import signal
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)
    while True:
        pass
def hangs_or_correct(prompt, response, answer):
    if response == "hang":
        time.sleep(60)
    return float(response == str(answer))
def dispatch(prompt, response, answer):
    if response in globals():
        return globals()[response](prompt, "a" * 40 + "b", answer)
    return float(response == str(answer))
"""
HANGING_FUNCTIONS = [
    "regex",
    "sleeps",
    "busy_c",
    "blocks_loop",
    "awaits_forever",
    "ignores_signals",
]


def test_deadlines_hold_whatever_the_verifier_does(tmp_path, nothing_left_behind):
    scorer = Scorer("math", {"timeout_s": 0.5}, processes=2)
    gold = Prompt("m", "?", "5")
    try:
        verdicts, elapsed = _timed(list, scorer.score_stream([(gold, r) for r in RUNAWAY_MATH]))
        assert [v.reward for v in verdicts] == [0.0] * len(RUNAWAY_MATH)
        assert elapsed < len(RUNAWAY_MATH) / 2 * (0.5 + SLACK_S)
        assert score_one(scorer, gold, r"so \boxed{5}").reward == 1.0
    finally:
        scorer.close()

    path = tmp_path / "hangs.py"
    path.write_text(HANGING_PLUGIN)
    prompt = Prompt("p", "1+1=", 2)
    scorer = Scorer("arithmetic", plugin=f"{path}:dispatch", timeout_s=0.3, processes=2)
    try:
        for function in HANGING_FUNCTIONS:
            verdict, elapsed = _timed(score_one, scorer, prompt, function)
            assert (verdict.reward, verdict.error) == (0.0, "timeout"), function
            assert elapsed < 0.3 + SLACK_S, function
        assert score_one(scorer, prompt, "2").reward == 1.0
    finally:
        scorer.close()


def test_many_timeouts_leave_a_worker_that_still_scores_correctly(tmp_path, nothing_left_behind):
    # Past the old 16-straggler cap of a thread-based deadline: processes are killed instead.
    path = tmp_path / "hangs.py"
    path.write_text(HANGING_PLUGIN)
    scorer = Scorer("arithmetic", plugin=f"{path}:hangs_or_correct", timeout_s=0.05, processes=2)
    prompt = Prompt("p", "1+1=", 2)
    past_the_cap = 17  # each timeout restarts a process: one past the cap shows it
    try:
        verdicts = list(scorer.score_stream([(prompt, "hang")] * past_the_cap))
        assert [v.error for v in verdicts] == ["timeout"] * past_the_cap
        assert scorer.timeouts == past_the_cap
        restarts = scorer.pool.restarts
        for _ in range(3):  # and calls that return in time never cost a restart
            assert score_one(scorer, prompt, "2").reward == 1.0
        assert scorer.pool.restarts == restarts
    finally:
        scorer.close()


def test_a_reward_batch_never_outlasts_its_budget(tmp_path, nothing_left_behind):
    path = tmp_path / "hangs.py"
    path.write_text(HANGING_PLUGIN)
    worker_timeout = 1.0
    scorer = Scorer("arithmetic", plugin=f"{path}:sleeps", timeout_s=worker_timeout, processes=2)
    prompt = Prompt("p", "1+1=", 2)
    try:
        verdicts, elapsed = _timed(list, scorer.score_stream([(prompt, "x")] * 16, worker_timeout))
    finally:
        scorer.close()
    assert all(v.error == "timeout" for v in verdicts)
    assert elapsed < worker_timeout + SLACK_S  # not 16 timeouts one after another


LONG_GOLDS = [
    ", ".join(str(i) for i in range(1, 300)),
    "+".join(f"{i}x^{{{i}}}" for i in range(1, 60)),
    "+".join(f"\\sqrt{{{i}}}" for i in range(2, 60)),
    # Under 200 characters, so parsed: compared with a wrong answer, sympy took 2-5 s (issue
    # 39: a scorer restart, not a verdict); the comparison's budget ends it as a refusal.
    "+".join(f"\\sin({i}x)\\cos({i + 1}x)" for i in range(1, 10)),
]


def test_a_long_gold_answer_is_judged_not_timed_out(nothing_left_behind):
    # A 1,400-character gold answer took 3.4 s to compare with `x+1`: past a 1 s deadline.
    scorer = Scorer("math", {"timeout_s": 1.0}, processes=2)
    work = [
        (Prompt(f"g{i}", "?", gold), response)
        for i, gold in enumerate(LONG_GOLDS)
        for response in (f"\\boxed{{{gold}}}", "\\boxed{x+1}", "\\boxed{5}")
    ]
    try:
        verdicts = list(scorer.score_stream(work))
    finally:
        scorer.close()
    assert [v.error for v in verdicts] == [None] * len(work)
    assert [v.reward for v in verdicts] == [1.0, 0.0, 0.0] * len(LONG_GOLDS)
    assert scorer.pool.restarts == 0


# --- extraction cost -----------------------------------------------------------------------

HUGE = 400_000  # characters: 20x the extraction window


@pytest.mark.parametrize(
    ("task_name", "response"),
    [
        ("math", "\\boxed{" * (HUGE // 7)),
        ("math", "\\boxed{" + "{" * HUGE),
        ("math", "\\fbox " * (HUGE // 6)),
        ("math", "the answer is " * (HUGE // 14)),
        ("math", "1," * (HUGE // 2)),
        ("math", "9" * HUGE),
        ("countdown", "<answer>" * (HUGE // 8)),
        ("countdown", "<ANSWER>" * (HUGE // 16) + "</answer>" * (HUGE // 18)),
        ("knights_and_knaves", "<answer>" * (HUGE // 8)),
        ("knights_and_knaves", "Zoey, " * (HUGE // 6)),
        ("code", "```python\n" * (HUGE // 10)),
    ],
)
def test_extraction_is_linear_on_a_bounded_window(task_name, response):
    options = {"allow_weak_sandbox": True} if task_name == "code" else None
    task = make_task(task_name, options)
    prompt = next(iter(task.train_prompts(0)))
    verdict, elapsed = _timed(task.verify, prompt, response)
    assert verdict.reward == 0.0
    # Quadratic extraction took 11 s on 17 KB and 24 s on 96 KB; this is 400 KB.
    assert elapsed < 5.0


# --- sandbox: what the program can read ----------------------------------------------------


def test_the_sandbox_sees_only_the_interpreter_and_its_work_directory(
    tmp_path, nothing_left_behind
):
    dataset = tmp_path / "secret_dataset.jsonl"
    dataset.write_text('{"prompt": "p", "answer": "SECRET-ANSWER"}\n')
    targets = [
        code_problems.__file__,  # the built-in code task's answer key
        str(dataset),
        "/etc/passwd",
        "/proc/1/environ",
        "/proc/self/status",
        "/root/.bashrc",
        "/work/main/README.md",
        os.path.realpath(sys.executable),
        "/usr/bin/env",
    ]
    program = "import os\n" + "".join(
        f"try:\n    open({t!r}, 'rb').read(1)\n    print('READ', {t!r})\nexcept OSError:\n    print('hidden')\n"
        for t in targets[:-2]
    )
    program += "print(sorted(os.listdir('/')))\nprint(sorted(os.listdir('/tmp')))\n"
    program += "import glob\nprint(len(glob.glob('/usr/lib/python3*/site-packages/*')))\n"
    result = sandbox.run_python(program, SMALL)
    assert result.returncode == 0, result.stderr
    assert "READ" not in result.stdout
    lines = result.stdout.splitlines()
    assert lines.count("hidden") == len(targets) - 2
    assert set(eval(lines[-3])) <= {"tmp", "dev", "lib", "lib64", "usr", "bin", "root"}
    assert eval(lines[-2]) == ["work"]
    # a solution that reads the answer key instead of solving the problem scores 0
    cheat = f"def gcd(a, b):\n    text = open({code_problems.__file__!r}).read()\n    return 6\n"
    task = CodeTask(timeout_s=3.0, case_timeout_s=1.0, memory_mb=128)
    prompt = next(p for p in task.pool.train if p.answer["entry_point"] == "gcd")
    assert task.verify(prompt, f"```python\n{cheat}```").reward == 0.0


# --- sandbox: escapes ----------------------------------------------------------------------

CTYPES_ATTEMPTS = [
    "import ctypes; ctypes.CDLL(None)",
    "import importlib; importlib.import_module('ctypes').CDLL(None)",
    "__import__('_ctypes')",
    "import importlib.util, glob, sys\n"
    "path = glob.glob(sys.prefix + '/lib/python3*/lib-dynload/_ctypes*.so')[0]\n"
    "spec = importlib.util.spec_from_file_location('innocent._ctypes', path)\n"
    "importlib.util.module_from_spec(spec)",
    "import importlib.machinery, glob, sys\n"
    "path = glob.glob(sys.prefix + '/lib/python3*/lib-dynload/_ctypes*.so')[0]\n"
    "importlib.machinery.ExtensionFileLoader('x._ctypes', path).load_module()",
    "import sys; sys.modules.pop('ctypes', None); import ctypes.util",
]
MEMORY_ATTEMPTS = [
    "import os; fd = os.memfd_create('x')",
    "import posix; fd = posix.memfd_create('x')",
    "import importlib, posix; importlib.reload(posix); fd = posix.memfd_create('x')",
    "import _posixshmem; fd = _posixshmem.shm_open('/x', os.O_CREAT | os.O_RDWR, 0o600)",
    "fd = os.open('/dev/shm/x', os.O_CREAT | os.O_RDWR)",
    "fd = os.open('/tmp/work/big', os.O_CREAT | os.O_RDWR)",
]


@pytest.mark.parametrize("attempt", CTYPES_ATTEMPTS)
def test_ctypes_cannot_be_loaded_however_it_is_imported(attempt, nothing_left_behind):
    result = sandbox.run_python(f"{attempt}\nprint('ESCAPED')", SMALL)
    assert "ESCAPED" not in result.stdout, result.stderr
    assert result.returncode != 0


@pytest.mark.parametrize("attempt", MEMORY_ATTEMPTS)
def test_memory_outside_the_address_space_limit_is_capped(attempt, nothing_left_behind):
    # 1 GiB through a file descriptor, never mapped: RLIMIT_AS does not see it; the cgroup,
    # the tmpfs size and the file-size limit do.
    program = (
        "import os\n"
        f"{attempt}\n"
        "chunk = b'x' * (1 << 20)\n"
        "for _ in range(1024):\n"
        "    os.write(fd, chunk)\n"
        "print('HELD 1 GiB')\n"
    )
    result = sandbox.run_python(program, SMALL)
    assert "HELD" not in result.stdout


def test_the_memory_cgroup_caps_what_a_hookless_subprocess_holds(nothing_left_behind):
    # A subprocess has no audit hook: memfd_create works there, and only the cgroup stops
    # 60 memfds of 15 MiB each (RLIMIT_AS never sees them, RLIMIT_FSIZE caps each one).
    if "memory-cgroup" not in sandbox.default_platform().isolation:
        pytest.skip("no memory cgroup on this host (docs/sandbox.md: a weak platform)")
    inner = (
        "import os\nchunk = b'x' * (1 << 20)\nfds = []\n"
        "for n in range(60):\n    fd = os.memfd_create('x')\n"
        "    for i in range(15):\n        os.write(fd, chunk)\n    fds.append(fd)\n"
        "print('HELD 900 MiB', flush=True)\n"
    )
    program = (
        f"import subprocess, sys\nsubprocess.run([sys.executable, '-I', '-S', '-c', {inner!r}])"
    )
    limits = sandbox.Limits(wall_s=20, cpu_s=20, memory_mb=256, max_processes=6, disk_mb=16)
    result = sandbox.run_python(program, limits, allow_subprocess=True)
    assert "HELD" not in result.stdout


def test_system_v_ipc_objects_die_with_the_run(nothing_left_behind):
    # Without ctypes the program reaches SysV IPC only through a helper it cannot run;
    # the IPC namespace is the wall whatever it manages: the host's `ipcs` stays unchanged.
    program = (
        "import os, glob\nprint(sorted(glob.glob('/dev/shm/*')), os.path.exists('/dev/mqueue'))\n"
    )
    result = sandbox.run_python(program, SMALL)
    assert result.stdout.strip() == "[] False"
    assert "ipc-namespace" in sandbox.default_platform().isolation


@pytest.mark.skipif(not IS_ROOT, reason="finding sandbox processes relies on their own uid")
def test_sandboxes_die_with_the_scorer_that_started_them(tmp_path, nothing_left_behind):
    runner = tmp_path / "runner.py"
    runner.write_text(
        "from groupflow.reward_workers import sandbox\n"
        "sandbox.default_platform()\n"
        "print('started', flush=True)\n"
        "sandbox.run_python('import time\\ntime.sleep(120)', sandbox.Limits(wall_s=120, cpu_s=120))\n"
    )
    scorer = subprocess.Popen([sys.executable, str(runner)], stdout=subprocess.PIPE, text=True)
    assert scorer.stdout.readline() == "started\n"
    # wait for the sandbox to be up and sleeping (a busy machine takes its time: poll, never a
    # fixed pause), and kill the scorer whatever happens, so that a failure leaves nothing behind
    up_by = time.monotonic() + 60.0
    while not _sandbox_uid_processes() and time.monotonic() < up_by and scorer.poll() is None:
        time.sleep(0.05)
    sleepers = _sandbox_uid_processes()
    scorer.send_signal(signal.SIGKILL)
    assert sleepers, "the sandbox did not start"
    scorer.wait()
    scorer.stdout.close()
    deadline = time.monotonic() + 5.0
    while _sandbox_uid_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    left = _sandbox_uid_processes()
    assert left == [], [Path(f"/proc/{pid}/cmdline").read_bytes()[:200] for pid in left]
    # the next run removes the killed scorer's empty cgroup
    assert sandbox.run_python("print(1)", SMALL).stdout == "1\n"


def _sandbox_uid_processes() -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                status = Path(f"/proc/{entry.name}/status").read_text()
            except OSError:
                continue
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            if int(fields["Uid"].split()[0]) >= 1_000_000 and "Z" not in fields["State"]:
                found.append(int(entry.name))
    return found


def test_the_program_has_no_privileges_to_undo_the_walls(nothing_left_behind):
    program = textwrap.dedent(
        """
        import os
        for name, attempt in [
            ("chroot", lambda: os.chroot("/")),
            ("setuid", lambda: os.setuid(0)),
            ("chmod", lambda: os.chmod("/usr", 0o777)),
            ("mknod", lambda: os.mknod("/tmp/work/null", 0o666 | 0o020000, os.makedev(1, 3))),
            ("write-root", lambda: open("/escape", "w")),
            ("write-usr", lambda: open(os.path.realpath(os.__file__), "a")),
            ("exec-tmp", lambda: (open("x", "w").write("#!/bin/sh\\n"), os.chmod("x", 0o755), os.execv("x", ["x"]))),
        ]:
            try:
                attempt()
                print("DID", name)
            except (OSError, PermissionError) as err:
                print("refused", name)
        """
    )
    result = sandbox.run_python(program, SMALL, allow_subprocess=True)
    assert "DID" not in result.stdout, result.stdout + result.stderr
    assert result.stdout.count("refused") == 7


def test_a_non_root_worker_gets_namespaces_and_a_non_root_program():
    """Runs the sandbox module as `nobody` (system python, copied module): user namespaces
    stand in for root, the program is uid 1000 of a nested namespace, and without a memory
    cgroup the platform reports itself weak (code rewards refuse to start)."""
    report = run_sandbox_as_nobody(
        "p = sandbox.default_platform()\n"
        "program = ('import os\\nprint(os.getuid())\\n'\n"
        '           \'for a in (lambda: os.chroot("/"), lambda: open("/escape", "w")):\\n\'\n'
        '           \'    try:\\n        a()\\n        print("DID")\\n    except OSError:\\n        print("refused")\\n\'\n'
        "           'print(sorted(os.listdir(\"/\")))')\n"
        "r = sandbox.run_python(program)\n"
        "print(json.dumps({'isolation': p.isolation, 'missing': p.missing, 'out': r.stdout}))\n",
        timeout=120,
    )
    assert "minimal-root" in report["isolation"] and "ipc-namespace" in report["isolation"]
    lines = report["out"].splitlines()
    assert lines[0] == "1000"
    assert lines[1:3] == ["refused", "refused"]
    assert "work" not in lines[3] and "root" not in lines[3]
    assert "memory-cgroup" in report["missing"]


def test_weak_platforms_refuse_code_rewards_unless_opted_out(monkeypatch):
    weak = sandbox.probe_platform(namespaces=False)
    monkeypatch.setattr(sandbox_probe, "_platform", weak)
    with pytest.raises(ValueError, match="lacks minimal-root.*allow_weak_sandbox") as err:
        CodeTask()
    assert "\n" not in str(err.value)
    task = CodeTask(allow_weak_sandbox=True, timeout_s=3.0)
    prompt = next(p for p in task.pool.train if p.answer["entry_point"] == "gcd")
    solution = "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n"
    assert task.verify(prompt, f"```python\n{solution}```").reward == 1.0


# --- false negatives -----------------------------------------------------------------------

CORRECT_WITH_FILES = [
    "import tempfile\ndef gcd(a, b):\n    with tempfile.TemporaryFile() as f:\n"
    "        f.write(b'x')\n    while b:\n        a, b = b, a % b\n    return a\n",
    "import os\ndef gcd(a, b):\n    open('scratch.txt', 'w').write('x')\n    os.remove('scratch.txt')\n"
    "    while b:\n        a, b = b, a % b\n    return a\n",
    "import tempfile, shutil, os\ndef gcd(a, b):\n    with tempfile.TemporaryDirectory() as d:\n"
    "        os.mkdir(os.path.join(d, 'sub'))\n        open(os.path.join(d, 'sub', 'f'), 'w').close()\n"
    "    while b:\n        a, b = b, a % b\n    return a\n",
    "import tempfile, os\ndef gcd(a, b):\n    fd, name = tempfile.mkstemp()\n    os.close(fd)\n"
    "    os.rename(name, name + '.2')\n    os.unlink(name + '.2')\n"
    "    while b:\n        a, b = b, a % b\n    return a\n",
]


@pytest.mark.parametrize("platform_kind", ["strongest", "no-namespaces"])
def test_correct_solutions_that_use_files_score_one(
    platform_kind, monkeypatch, nothing_left_behind
):
    if platform_kind == "no-namespaces":
        monkeypatch.setattr(sandbox_probe, "_platform", sandbox.probe_platform(namespaces=False))
    task = CodeTask(timeout_s=5.0, case_timeout_s=2.0, memory_mb=128, allow_weak_sandbox=True)
    prompt = next(p for p in task.pool.train if p.answer["entry_point"] == "gcd")
    for solution in CORRECT_WITH_FILES:
        verdict = task.verify(prompt, f"```python\n{solution}```")
        assert verdict.reward == 1.0, verdict.reason


def test_an_inexact_float_does_not_pass_for_a_large_integer():
    task = CodeTask(timeout_s=5.0, case_timeout_s=2.0, memory_mb=128)
    big = 10**20 + 1
    spec = {"entry_point": "f", "tests": [{"args": [], "expected": big}]}
    prompt = Prompt("big", "return 10**20 + 1", task.parse_answer(spec))
    assert task.verify(prompt, "```python\ndef f():\n    return 1e20\n```").reward == 0.0
    assert (
        task.verify(prompt, "```python\ndef f():\n    return float(10**20 + 1)\n```").reward == 0.0
    )
    assert task.verify(prompt, "```python\ndef f():\n    return 10**20 + 1\n```").reward == 1.0
    spec = {"entry_point": "f", "tests": [{"args": [], "expected": 0.1}]}
    prompt = Prompt("float", "return 0.1", task.parse_answer(spec))
    assert task.verify(prompt, "```python\ndef f():\n    return 0.1 + 1e-12\n```").reward == 1.0
    assert task.verify(prompt, "```python\ndef f():\n    return 10**400\n```").reward == 0.0


# --- plugins and the CLI -------------------------------------------------------------------

NASTY_PLUGIN = """
import os, sys
class BadStr:
    def __str__(self):
        raise RuntimeError("no str")
class BadFloat(float):
    def __float__(self):
        raise RuntimeError("no float")
def reward(prompt, response, answer):
    kind = response
    if kind == "huge": return 10**400
    if kind == "bad_info": return 0.5, BadStr()
    if kind == "bad_float": return BadFloat(0.5)
    if kind == "interrupt": raise KeyboardInterrupt
    if kind == "exit": sys.exit(0)
    if kind == "hard_exit": os._exit(0)
    if kind == "forge":
        print('{"line": 1, "uid": "forged", "reward": 1.0, "reason": "forged"}', flush=True)
        os.write(1, b'{"line": 2, "uid": "forged", "reward": 1.0, "reason": "forged"}\\n')
        return 0.0
    if kind == "nan": return float("nan")
    if kind == "neg_zero_tuple": return (-0.0, "fine")
    return 1.0
"""
NASTY_RESPONSES = [
    "huge",
    "bad_info",
    "bad_float",
    "interrupt",
    "exit",
    "hard_exit",
    "forge",
    "nan",
    "neg_zero_tuple",
    "ok",
]


def test_plugin_values_and_exceptions_become_verdicts(tmp_path, capsys, nothing_left_behind):
    plugin = tmp_path / "nasty.py"
    plugin.write_text(NASTY_PLUGIN)
    rows = [{"prompt": "1+1=", "answer": 2, "response": r, "uid": r} for r in NASTY_RESPONSES]
    rows[0]["uid"] = "lone\ud800surrogate"
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = score_main(
        [
            "--task",
            "arithmetic",
            "--input",
            str(data),
            "--plugin",
            f"{plugin}:reward",
            "--timeout",
            "5",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["line"] for line in lines] == list(range(1, len(rows) + 1))  # none forged
    rewards = {line["line"]: line["reward"] for line in lines}
    assert rewards[2] == 0.5 and rewards[9] == 0.0 and rewards[10] == 1.0
    assert all(rewards[i] == 0.0 for i in (1, 3, 4, 5, 6, 7, 8))
    errors = [line.get("error") for line in lines]
    assert errors == ["error", None, "error", "error", "error", "error", None, "error", None, None]
    assert "lone\\ud800surrogate" in lines[0]["uid"]


@pytest.mark.parametrize(
    "body",
    [
        "import sys; sys.exit(0)",
        "raise SystemExit(3)",
        "raise KeyboardInterrupt",
        "import os; os._exit(0)",
    ],
)
def test_a_plugin_that_exits_at_import_is_a_one_line_error(tmp_path, capsys, body):
    plugin = tmp_path / "exits.py"
    plugin.write_text(body + "\n")
    data = tmp_path / "in.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": 2, "response": "2"}\n')
    code = score_main(["--task", "arithmetic", "--input", str(data), "--plugin", f"{plugin}:f"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    (line,) = [line for line in err.splitlines() if line.startswith("groupflow score:")]
    assert "exits.py" in line or "scorer process" in line


MALFORMED_ROWS = [
    ("deep nesting", '{"prompt": "p", "answer": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    ("5000-digit answer", '{"prompt": "p", "answer": ' + "7" * 5000 + "}"),
    ("5000-digit uid", '{"prompt": "p", "answer": 1, "uid": ' + "7" * 5000 + "}"),
    ("invalid UTF-8", b'{"prompt": "\xff", "answer": 1}'.decode("latin-1")),
    ("not an object", "[1, 2]"),
    ("bad JSON", '{"prompt": '),
    ("missing prompt", '{"answer": 1}'),
    ("answer type", '{"prompt": "p", "answer": [1]}'),
    ("big float", '{"prompt": "p", "answer": 1e999}'),
]


@pytest.mark.parametrize(("what", "row"), MALFORMED_ROWS)
def test_malformed_rows_give_file_line_errors_or_are_skipped(tmp_path, capsys, what, row):
    data = tmp_path / "rows.jsonl"
    good = '{"prompt": "1+1=", "answer": 2, "response": "2"}'
    data.write_bytes(
        (good + "\n" + row + "\n").encode(
            "latin-1" if what == "invalid UTF-8" else "utf-8", "surrogatepass"
        )
    )
    code = score_main(["--task", "arithmetic", "--input", str(data)])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    (line,) = err.splitlines()
    assert line.startswith(f"groupflow score: {data}:2:"), line
    loaded = load_prompts(data, skip_bad=True, parse_answer=make_task("arithmetic").parse_answer)
    assert (len(loaded.prompts), loaded.skipped) == (1, 1)


def test_lone_surrogates_in_answers_and_responses_are_scored(tmp_path, capsys):
    data = tmp_path / "rows.jsonl"
    data.write_text(
        '{"prompt": "p\\ud800", "answer": "5", "response": "\\\\boxed{5} \\ud800", "uid": "\\udc80"}\n'
        '{"prompt": "p", "answer": "5\\udfff", "response": "\\\\boxed{6\\ud800}"}\n'
    )
    code = score_main(["--task", "math", "--input", str(data)])
    out, _ = capsys.readouterr()
    assert code == 0
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["reward"] for line in lines] == [1.0, 0.0]
    assert lines[0]["uid"] == "\\udc80"


# --- numeric settings ----------------------------------------------------------------------

BAD_NUMBERS = [float("nan"), float("inf"), float("-inf"), -1.0, 0.0, True, "3", 10**400]


@pytest.mark.parametrize("value", BAD_NUMBERS, ids=repr)
def test_every_numeric_setting_is_finite_and_in_range(value):
    for task, option in [
        ("math", "timeout_s"),
        ("code", "timeout_s"),
        ("code", "case_timeout_s"),
        ("code", "memory_mb"),
        ("math", "eval_fraction"),
        ("arithmetic", "digits"),
        ("countdown", "count"),
        ("knights_and_knaves", "people"),
    ]:
        with pytest.raises(ValueError) as err:
            make_task(task, {option: value})
        assert "\n" not in str(err.value)
    if value != 0.0:  # 0 is a valid weight
        with pytest.raises(ValueError, match="format_weight"):
            MathTask(format_weight=value)
    with pytest.raises(ValueError, match="timeout"):
        Scorer("arithmetic", timeout_s=value)
    if isinstance(value, float):
        with pytest.raises(ValueError):
            build_config({}, [f"reward.timeout_s={value}"])


def test_non_finite_cli_timeouts_are_refused(tmp_path, capsys):
    data = tmp_path / "in.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": 2, "response": "2"}\n')
    for value in ("nan", "inf", "-1", "0"):
        code = score_main(["--task", "arithmetic", "--input", str(data), "--timeout", value])
        _, err = capsys.readouterr()
        assert code == 2 and "timeout" in err and len(err.splitlines()) == 1
    for option in ("timeout_s=NaN", "timeout_s=Infinity", "format_weight=NaN"):
        code = score_main(["--task", "math", "--input", str(data), "--option", option])
        _, err = capsys.readouterr()
        assert code == 2 and len(err.splitlines()) == 1
