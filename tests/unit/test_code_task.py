"""The code task: extraction, test specs, comparison, and sandboxed runs of solutions."""

import dis
import itertools
import json
import time
from pathlib import Path

import pytest

from groupflow.core.records import Prompt
from groupflow.reward_workers.tasks import code_tests
from groupflow.reward_workers.tasks.code_problems import CodeTask
from groupflow.reward_workers.tasks.code_tests import extract_code, parse_spec, same_value

GCD_SPEC = {
    "entry_point": "gcd",
    "tests": [
        {"args": [12, 18], "expected": 6},
        {"args": [17, 5], "expected": 1},
        {"args": [0, 9], "expected": 9},
        {"args": [0, 0], "expected": 0},
    ],
}
GCD = "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n"


def _nested(depth: int, leaf: object) -> list:
    value = [leaf]
    for _ in range(depth):
        value = [value, 0]
    return value


def fenced(code: str) -> str:
    return f"Here you go:\n```python\n{code}```\n"


@pytest.fixture(scope="module")
def task():
    return CodeTask(timeout_s=3.0, case_timeout_s=0.3, memory_mb=128)


def test_extract_code():
    assert extract_code("```python\nx = 1\n```\ntext\n```py\ny = 2\n```") == "y = 2\n"
    assert extract_code("```\nz = 3\n```") == "z = 3\n"
    assert extract_code("```python\ndef f():\n    return 1") == "def f():\n    return 1"  # cut off
    assert extract_code("def f(): return 1") == "def f(): return 1"
    assert extract_code("I cannot solve this.") is None
    assert extract_code("") is None


SOLUTION = "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n"


@pytest.mark.parametrize(
    "response",
    [
        f"```python\n{SOLUTION}```\nUsage:\n```python\nprint(gcd(12, 18))\n```",
        f"```python\n{SOLUTION}```\nOutput:\n```\n6\n```",
        f"```python\n{SOLUTION}```\n```python\ngcd(12, 18)\n```\n```text\n6\n```",
        f"```python\n{SOLUTION}```\nTest:\n```python\nassert gcd(12, 18) == 6\n```",
        f"```python\n{SOLUTION}```\n```python\nresult = gcd(2, 4)\n```",
        f"```python\n{SOLUTION}```".replace("\n", "\r\n"),
        f"```py\r\n{SOLUTION}```\r\n```\r\n6\r\n```".replace("\n    ", "\r\n    "),
        f"```python\ndef gcd(a, b):\n    return 0\n```\nFixed:\n```python\n{SOLUTION}```\n"
        "```python\nprint(gcd(1, 2))\n```",
    ],
)
def test_extraction_picks_the_block_that_defines_the_function(response):
    code = extract_code(response, "gcd")
    assert code is not None and "\r" not in code
    assert code.strip() == SOLUTION.strip()


def test_extraction_without_a_defining_block_keeps_the_last_block():
    assert extract_code("```python\nx = 1\n```\n```python\ny = 2\n```", "gcd") == "y = 2\n"
    assert extract_code("```python\r\nx = 1\r\n```", None) == "x = 1\n"


def test_parse_spec_validates():
    assert parse_spec(GCD_SPEC) == GCD_SPEC
    assert (
        parse_spec('{"entry_point": "f", "tests": [{"args": [], "expected": null}]}')["entry_point"]
        == "f"
    )
    for bad in (
        {"entry_point": "f"},
        {"entry_point": "not a name", "tests": [{"args": [], "expected": 1}]},
        {"entry_point": "f", "tests": []},
        {"entry_point": "f", "tests": [{"args": 1, "expected": 1}]},
        "{not json",
        [1, 2],
    ):
        with pytest.raises(ValueError):
            parse_spec(bad)


@pytest.mark.parametrize(
    ("got", "expected", "same"),
    [
        (1, 1, True),
        (0.1 + 0.2, 0.3, True),
        (2, 2.0, True),
        (True, 1, False),
        (1, True, False),
        (None, None, True),
        ([1, [2, 3]], [1, [2, 3]], True),
        ([1, 2], [1, 2, 3], False),
        ({"a": 1.0}, {"a": 1}, True),
        ({"a": 1}, {"b": 1}, False),
        ("1", 1, False),
        (float("nan"), float("nan"), True),  # was False: a NaN result meets a NaN expectation
        (float("nan"), 0.0, False),
        (0.0, float("nan"), False),
        (None, float("nan"), False),
        ([1.0, {"x": [float("nan")]}], [1.0, {"x": [float("nan")]}], True),
        ([1.0, {"x": [float("nan")]}], [1.0, {"x": [2.0]}], False),
        (float("inf"), float("inf"), True),
        (float("-inf"), float("inf"), False),
        (_nested(3000, 1), _nested(3000, 1), True),
        (_nested(3000, 1), _nested(3000, 2), False),
        (_nested(3000, 1), _nested(2999, 1), False),
        ({"k": _nested(2000, float("nan"))}, {"k": _nested(2000, float("nan"))}, True),
    ],
)
def test_same_value(got, expected, same):
    assert same_value(got, expected) is same


def _verify(task, code):
    return task.verify(Prompt("gcd", "write gcd", GCD_SPEC), fenced(code))


def test_correct_solution_gets_full_reward(task):
    verdict = _verify(task, GCD)
    assert verdict.reward == 1.0
    assert verdict.reason == "passed 4/4 tests"


def test_reward_is_the_fraction_of_tests_passed(task):
    verdict = _verify(task, "def gcd(a, b):\n    return max(a, b)\n")  # right only when one is 0
    assert verdict.reward == 0.5
    assert "gcd(12, 18) returned 18, expected 6" in verdict.reason


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        ("def gcd(a, b) return 1\n", "did not load: SyntaxError"),
        ("def other(a, b):\n    return 1\n", "no function named gcd"),
        ("raise SystemExit(0)\n", "did not load: SystemExit"),
        ("import os\nos._exit(0)\n", "program died"),
        ("def gcd(a, b):\n    raise ValueError('nope')\n", "raised ValueError: nope"),
        ("def gcd(a, b):\n    return gcd(a, b)\n", "RecursionError"),
        ("def gcd(a, b):\n    return {1, 2}\n", "not JSON serializable"),
        ("def gcd(a, b):\n    return bytearray(1024 ** 3)\n", "MemoryError"),
        # the minimal root has no /etc at all
        ("def gcd(a, b):\n    return open('/etc/passwd', 'a')\n", "FileNotFoundError"),
        (
            "def gcd(a, b):\n    import socket\n    return socket.create_connection(('1.1.1.1', 80))\n",
            "PermissionError",
        ),
        ("def gcd(a, b):\n    return '𝔤𝔠𝔡 ünïcødé'\n", "returned"),
    ],
)
def test_broken_and_hostile_solutions_score_zero(task, code, reason):
    verdict = _verify(task, code)
    assert verdict.reward == 0.0
    assert reason in verdict.reason


# Issue 39: a correct program that first tries to break out (rewriting every frame's globals,
# as a sandbox bypass does) scored 0, the harness failing with "'frozenset' object has no
# attribute 'clear'". The harness shares the interpreter; none of this may reach its objects.
HARNESS_ATTACKS = {
    "every-frames-globals": (
        "def rewrite(frame):\n"
        "    while frame is not None:\n"
        "        for key in list(frame.f_globals):\n"
        "            if not key.startswith('__'):\n"
        "                frame.f_globals[key] = frozenset()\n"
        "        frame = frame.f_back\n"
        "import sys\n"
        "rewrite(sys._getframe())\n"
    ),
    "patched-modules": (
        "import json, os, signal, builtins\n"
        "json.dumps = lambda *a, **k: frozenset().clear()\n"
        "json.encoder.c_make_encoder = None\n"
        "os.write = os.dup2 = lambda *a: None\n"
        "signal.setitimer = signal.signal = lambda *a: None\n"
        "builtins.enumerate = builtins.callable = builtins.str = lambda *a: frozenset()\n"
    ),
    "alarm-to-itself": "import os, signal\nos.kill(os.getpid(), signal.SIGALRM)\n",
}


@pytest.mark.parametrize("attack", list(HARNESS_ATTACKS))
def test_a_correct_solution_that_attacks_the_harness_first_still_passes(task, attack):
    code = f"try:\n    exec({HARNESS_ATTACKS[attack]!r})\nexcept BaseException:\n    pass\n"
    verdict = _verify(task, code + GCD)
    assert (verdict.reward, verdict.reason) == (1.0, "passed 4/4 tests")


def test_the_harness_reads_no_global_or_builtin_name_once_the_solution_runs():
    """What runs after the solution loads takes everything from its arguments, as the audit
    hook's functions do (reward_workers/tasks/code_harness_child.py)."""
    source = (Path(code_tests.__file__).parent / "code_harness_child.py").read_text()
    module = compile(source, "code_harness_child.py", "exec")
    names = {"_on_alarm", "_unserializable", "_to_json", "_describe", "_report", "_run"}
    codes = [c for c in module.co_consts if getattr(c, "co_name", None) in names]
    assert {c.co_name for c in codes} == names
    for code in codes:
        assert code.co_freevars == () and code.co_cellvars == (), code.co_name
        loads = {i.opname for i in dis.get_instructions(code)}
        assert not loads & {"LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "STORE_GLOBAL"}, code.co_name


def test_an_exception_whose_str_raises_fails_its_case_only(task):
    code = (
        "class Sly(Exception):\n"
        "    def __str__(self):\n"
        "        raise Sly()\n"
        "def gcd(a, b):\n"
        "    if a == 12:\n"
        "        raise Sly()\n"
        "    while b:\n"
        "        a, b = b, a % b\n"
        "    return a\n"
    )
    verdict = _verify(task, code)
    assert verdict.reward == 0.75
    assert "gcd(12, 18) raised Sly" in verdict.reason


def test_an_endless_case_costs_only_itself():
    # A generous program budget: the unit tests run beside the integration tests on two
    # cores, where the sandbox's start alone took most of 3 s (the other cases went unrun)
    task = CodeTask(timeout_s=10.0, case_timeout_s=0.3, memory_mb=128)
    code = "def gcd(a, b):\n    while a == 12:\n        pass\n    while b:\n        a, b = b, a % b\n    return a\n"
    start = time.monotonic()
    verdict = _verify(task, code)
    assert verdict.reward == 0.75
    assert "timed out" in verdict.reason
    assert time.monotonic() - start < 10  # the endless case did not spend the program's budget


def test_a_solution_that_ignores_the_case_timeout_is_stopped():
    task = CodeTask(timeout_s=1.0, case_timeout_s=0.3, memory_mb=128)
    code = "def gcd(a, b):\n    while True:\n        try:\n            while True:\n                pass\n        except BaseException:\n            pass\n"
    start = time.monotonic()
    verdict = _verify(task, code)
    assert verdict.reward == 0.0
    assert "timed out" in verdict.reason
    assert time.monotonic() - start < 3


def test_printed_fake_results_do_not_count(task):
    forger = (
        "import os, sys\n"
        "for i in range(4):\n"
        '    print(\'{"case": %d, "value": 6}\' % i)\n'
        '    sys.__stdout__.write(\'{"case": %d, "value": 6}\\n\' % i)\n'
        '    os.write(1, b\'{"case": %d, "value": 6}\\n\' % i)\n'
        "def gcd(a, b):\n"
        "    return -1\n"
    )
    verdict = _verify(task, forger)
    assert verdict.reward == 0.0


def test_empty_and_codeless_responses(task):
    prompt = Prompt("gcd", "write gcd", GCD_SPEC)
    assert task.verify(prompt, "").reason == "no code found"
    assert task.verify(prompt, "```python\n```").reward == 0.0


def test_format_weight():
    task = CodeTask(timeout_s=3.0, case_timeout_s=0.3, memory_mb=128, format_weight=0.1)
    prompt = Prompt("gcd", "write gcd", GCD_SPEC)
    assert task.verify(prompt, fenced(GCD)).reward == pytest.approx(1.0)
    assert task.verify(prompt, GCD).reward == pytest.approx(0.9)


REFERENCE_SOLUTIONS = {
    "reverse_words": "def reverse_words(s):\n    return ' '.join(reversed(s.split()))\n",
    "is_palindrome": "def is_palindrome(s):\n    t = [c.lower() for c in s if c.isalnum()]\n    return t == t[::-1]\n",
    "fizzbuzz": (
        "def fizzbuzz(n):\n"
        "    return ['FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else 'Buzz' if i % 5 == 0 else str(i)\n"
        "            for i in range(1, n + 1)]\n"
    ),
    "gcd": GCD,
    "count_vowels": "def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)\n",
    "second_largest": "def second_largest(nums):\n    v = sorted(set(nums))\n    return v[-2] if len(v) > 1 else None\n",
    "run_length": (
        "import itertools\n"
        "def run_length(s):\n"
        "    return ''.join(f'{k}{len(list(g))}' for k, g in itertools.groupby(s))\n"
    ),
    "flatten": (
        "def flatten(items):\n"
        "    out = []\n"
        "    for x in items:\n"
        "        out.extend(flatten(x) if isinstance(x, list) else [x])\n"
        "    return out\n"
    ),
    "roman_to_int": (
        "def roman_to_int(s):\n"
        "    v = {'I': 1, 'V': 5, 'X': 10, 'L': 50, 'C': 100, 'D': 500, 'M': 1000}\n"
        "    return sum(-v[a] if v[a] < v[b] else v[a] for a, b in zip(s, s[1:] + 'I'))\n"
    ),
    "two_sum": (
        "def two_sum(nums, target):\n"
        "    for j, b in enumerate(nums):\n"
        "        for i in range(j):\n"
        "            if nums[i] + b == target:\n"
        "                return [i, j]\n"
    ),
    "max_subarray": (
        "def max_subarray(nums):\n"
        "    best = cur = nums[0]\n"
        "    for x in nums[1:]:\n"
        "        cur = max(x, cur + x)\n"
        "        best = max(best, cur)\n"
        "    return best\n"
    ),
    "is_prime": "def is_prime(n):\n    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))\n",
    "merge_intervals": (
        "def merge_intervals(intervals):\n"
        "    out = []\n"
        "    for s, e in sorted(intervals):\n"
        "        if out and s <= out[-1][1]:\n"
        "            out[-1][1] = max(out[-1][1], e)\n"
        "        else:\n"
        "            out.append([s, e])\n"
        "    return out\n"
    ),
    "balanced": (
        "def balanced(s):\n"
        "    stack, pairs = [], {')': '(', ']': '[', '}': '{'}\n"
        "    for c in s:\n"
        "        if c in '([{':\n"
        "            stack.append(c)\n"
        "        elif c in pairs and (not stack or stack.pop() != pairs[c]):\n"
        "            return False\n"
        "    return not stack\n"
    ),
    "binary_search": (
        "import bisect\n"
        "def binary_search(nums, target):\n"
        "    i = bisect.bisect_left(nums, target)\n"
        "    return i if i < len(nums) and nums[i] == target else -1\n"
    ),
    "mean": "def mean(nums):\n    return sum(nums) / len(nums)\n",
}


def test_every_builtin_problem_is_solvable_and_split(task):
    prompts = task.pool.train + task.pool.held_out
    assert {p.answer["entry_point"] for p in prompts} == set(REFERENCE_SOLUTIONS)
    for prompt in prompts:
        verdict = task.verify(prompt, fenced(REFERENCE_SOLUTIONS[prompt.answer["entry_point"]]))
        assert verdict.reward == 1.0, (prompt.uid, verdict.reason)
    held_out = task.eval_prompts(100)
    train = list(itertools.islice(task.train_prompts(0), 50))
    assert held_out and not {p.uid for p in held_out} & {p.uid for p in train}


def test_dataset_driven_code_task(tmp_path):
    path = tmp_path / "code.jsonl"
    row = '{"q": "Write gcd(a, b).", "spec": %s}\n'
    path.write_text(
        row % json.dumps(GCD_SPEC)
        + row % json.dumps(json.dumps(GCD_SPEC))
        + '{"q": "x", "spec": {"tests": []}}\n'
        + json.dumps({"q": "Write gcd(a, b) in Python.", "spec": GCD_SPEC})
    )
    with pytest.raises(ValueError, match=r"code.jsonl:3: field 'spec' \(answer\)"):
        CodeTask(dataset=str(path), fields={"prompt": "q", "answer": "spec"})
    task = CodeTask(
        dataset=str(path),
        fields={"prompt": "q", "answer": "spec"},
        skip_bad=True,
        eval_fraction=0.01,
    )
    # The two copies of a prompt stay on one side; the other prompt is on the other.
    assert sorted([len(task.pool.train), len(task.pool.held_out)]) == [1, 2]
    assert task.verify(task.pool.train[0], fenced(GCD)).reward == 1.0


@pytest.mark.parametrize(
    "response",
    [
        fenced(GCD) + "Example:\n```python\nprint(gcd(12, 18))  # 6\n```\n",
        fenced(GCD) + "Output:\n```\n6\n```\n",
        fenced(GCD).replace("\n", "\r\n"),
    ],
)
def test_a_solution_followed_by_an_example_or_in_crlf_scores_one(task, response):
    verdict = task.verify(Prompt("gcd", "write gcd", GCD_SPEC), response)
    assert verdict.reward == 1.0, verdict.reason


def test_nan_and_deeply_nested_expectations_pass_through_the_sandbox(task):
    spec = {
        "entry_point": "f",
        "tests": [
            {"args": [0], "expected": float("nan")},
            {"args": [1], "expected": [1.5, {"x": float("nan")}]},
            {"args": [2], "expected": _nested(400, 7)},
            {"args": [3], "expected": float("nan")},
        ],
    }
    code = (
        "def f(i):\n"
        "    if i == 2:\n"
        "        v = [7]\n"
        "        for _ in range(400):\n"
        "            v = [v, 0]\n"
        "        return v\n"
        "    return [float('nan'), [1.5, {'x': float('nan')}], None, 0.0][i]\n"
    )
    spec = parse_spec(json.dumps(spec))
    verdict = task.verify(Prompt("f", "f", spec), fenced(code))
    assert verdict.reward == 0.75, verdict.reason
    assert "f(3) returned 0.0, expected NaN" in verdict.reason


def test_a_test_nested_too_deep_to_copy_is_refused_in_one_line():
    """Round 3: an expected value nested ~900 deep passed the JSON reader and failed as a
    RecursionError while pickled to the scorer, with no verdict."""
    spec = {"entry_point": "f", "tests": [{"args": [1], "expected": _nested(900, 7)}]}
    with pytest.raises(ValueError) as err:
        parse_spec(spec)
    assert str(err.value) == "tests[0] is nested deeper than 500 levels"
