"""Run a model-written Python function against input/output test cases in the sandbox.

A test case is {"args": [...], "expected": ...} in JSON terms. The function runs in the
sandbox (reward_workers.sandbox) on every case's arguments; its return values come back as
JSON and are compared here, floats with a small tolerance (docs/verifiers.md).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from groupflow.reward_workers.sandbox import Limits, run_python

_HARNESS = (Path(__file__).parent / "code_harness_child.py").read_text()
_FENCED = re.compile(r"```(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_NESTING = 500  # levels of lists and dicts in a test (the test itself is the first two)


@dataclass(frozen=True)
class TestOutcome:
    passed: int
    total: int
    first_failure: str | None
    timed_out: bool


def parse_spec(raw: Any) -> dict[str, Any]:
    """Validate {"entry_point": name, "tests": [{"args": [...], "expected": ...}, ...]}."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as err:
            raise ValueError(f"tests are not valid JSON ({err.msg})") from None
        except (ValueError, RecursionError) as err:  # 5,000-digit numbers, deep nesting
            raise ValueError(f"tests are not readable JSON ({type(err).__name__})") from None
    if not isinstance(raw, dict) or set(raw) != {"entry_point", "tests"}:
        raise ValueError('expected {"entry_point": ..., "tests": [...]}')
    entry_point, tests = raw["entry_point"], raw["tests"]
    if not isinstance(entry_point, str) or not _IDENTIFIER.fullmatch(entry_point):
        raise ValueError(f"entry_point must be a function name (got {entry_point!r})")
    if not isinstance(tests, list) or not tests:
        raise ValueError("tests must be a non-empty list")
    for i, test in enumerate(tests):
        if (
            not isinstance(test, dict)
            or set(test) != {"args", "expected"}
            or not isinstance(test["args"], list)
        ):
            raise ValueError('every test must be {"args": [...], "expected": ...}')
        if _depth(test) > MAX_NESTING:
            # every copy of it (pickling to the scorer, JSON to the sandbox, comparing)
            # recurses: a RecursionError there would leave the response without a verdict
            raise ValueError(f"tests[{i}] is nested deeper than {MAX_NESTING} levels")
    return {"entry_point": entry_point, "tests": tests}


def _depth(value: Any) -> int:
    """How deep lists and dicts nest in `value`, counted without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, list | dict):
            deepest = max(deepest, depth)
            if depth <= MAX_NESTING:
                children = item.values() if isinstance(item, dict) else item
                stack.extend((child, depth + 1) for child in children)
    return deepest


def extract_code(response: str, entry_point: str | None = None) -> str | None:
    """The last fenced code block that defines `entry_point` (a usage example or the printed
    output in a later block is not the solution), else the last fenced block (an unclosed one
    at the end counts, as generation may stop mid-block), else the whole response if it
    defines a function. Line endings are normalised: a CRLF fence still opens a block."""
    response = response.replace("\r\n", "\n").replace("\r", "\n")
    blocks = _FENCED.findall(response)
    if not blocks:
        return response if "def " in response else None
    if entry_point is not None:
        name = re.escape(entry_point)
        defines = re.compile(
            rf"^[ \t]*(?:(?:async[ \t]+)?def[ \t]+{name}[ \t]*\(|class[ \t]+{name}\b"
            rf"|{name}[ \t]*=(?!=))",
            re.MULTILINE,
        )
        defining = [block for block in blocks if defines.search(block)]
        if defining:
            return defining[-1]
    return blocks[-1]


def run_tests(
    code: str, spec: dict[str, Any], *, timeout_s: float, case_timeout_s: float, memory_mb: int
) -> TestOutcome:
    """Run every case in one sandboxed program: timeout_s bounds the whole run,
    case_timeout_s each call (so one endless case does not cost the others)."""
    tests = spec["tests"]
    cases_json = json.dumps([test["args"] for test in tests])
    call = f"\nrun({code!r}, {spec['entry_point']!r}, {cases_json!r}, {float(case_timeout_s)!r})\n"
    limits = Limits(wall_s=timeout_s, cpu_s=math.ceil(timeout_s), memory_mb=memory_mb)
    result = run_python(_HARNESS + call, limits)

    reports: dict[int, dict[str, Any]] = {}
    load_error = None
    for line in result.stdout.splitlines():
        try:
            report = json.loads(line)
        except (ValueError, RecursionError):
            continue  # a result line cut off at the output limit counts as missing
        if not isinstance(report, dict):
            continue
        if "load_error" in report:
            load_error = str(report["load_error"])
        elif isinstance(report.get("case"), int):
            reports.setdefault(report["case"], report)
    if load_error is not None:
        return TestOutcome(0, len(tests), f"solution did not load: {load_error}", result.timed_out)

    passed, first_failure = 0, None
    for case, test in enumerate(tests):
        report = reports.get(case)
        if (
            report is not None
            and "value" in report
            and same_value(report["value"], test["expected"])
        ):
            passed += 1
            continue
        if first_failure is None:
            first_failure = _describe_failure(spec["entry_point"], test, report, result.timed_out)
    return TestOutcome(passed, len(tests), first_failure, result.timed_out)


def same_value(got: Any, expected: Any) -> bool:
    """JSON values equal, element by element at any depth (no recursion: a value nested as
    deep as JSON allows still compares): an expected integer exactly, an expected float to a
    relative/absolute tolerance of 1e-9, an expected NaN by a NaN; booleans never equal to
    numbers."""
    pending = [(got, expected)]
    while pending:
        got, expected = pending.pop()
        if isinstance(got, list) and isinstance(expected, list):
            if len(got) != len(expected):
                return False
            pending.extend(zip(got, expected, strict=True))
        elif isinstance(got, dict) and isinstance(expected, dict):
            if got.keys() != expected.keys():
                return False
            pending.extend((got[key], expected[key]) for key in got)
        elif not _same_scalar(got, expected):
            return False
    return True


def _same_scalar(got: Any, expected: Any) -> bool:
    if isinstance(got, bool) or isinstance(expected, bool):
        return type(got) is type(expected) and got == expected
    if isinstance(got, int | float) and isinstance(expected, int | float):
        if isinstance(expected, int):
            # Exact: a float near a large integer (1e20 for 10**20 + 1) is not that integer.
            return got == expected
        if math.isnan(expected):
            return isinstance(got, float) and math.isnan(got)
        try:
            return math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-9)
        except OverflowError:  # an integer too large for a float is not near any float
            return False
    return type(got) is type(expected) and got == expected


def _describe_failure(
    entry_point: str, test: dict[str, Any], report: dict | None, timed_out: bool
) -> str:
    call = f"{entry_point}({', '.join(json.dumps(a) for a in test['args'])})"
    if report is None:
        what = (
            "got no result (the program timed out)"
            if timed_out
            else "got no result (the program died)"
        )
    elif "failed" in report:
        what = str(report["failed"])
    else:
        what = (
            f"returned {json.dumps(report.get('value'))}, expected {json.dumps(test['expected'])}"
        )
    text = f"{call} {what}"
    return text if len(text) <= 200 else text[:197] + "..."
