"""Runs inside the sandbox: load the model's solution and call it on each test input.

reward_workers/tasks/code_tests.py appends a call `run(...)` to this file's text and runs the
result with reward_workers.sandbox; it is never imported. Each outcome is one JSON line on
the original stdout, {"case": i, "value": ...} or {"case": i, "failed": "..."}; anything the
solution prints goes to stderr. The expected outputs never enter the sandbox (the parent
compares), so a solution cannot report itself as passing.
"""

import json
import os
import signal
import sys


class CaseTimeout(BaseException):  # not an Exception: a solution's `except Exception` misses it
    pass


def run(solution: str, entry_point: str, cases_json: str, case_timeout_s: float) -> None:
    results = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def report(**fields: object) -> None:
        results.write(json.dumps(fields) + "\n")
        results.flush()

    namespace = {"__name__": "solution"}
    try:
        exec(compile(solution, "solution.py", "exec"), namespace)
    except BaseException as err:  # a solution that fails to load fails every test
        report(load_error=f"{type(err).__name__}: {err}"[:300])
        return
    function = namespace.get(entry_point)
    if not callable(function):
        report(load_error=f"no function named {entry_point}")
        return

    def on_alarm(_signum: int, _frame: object) -> None:
        raise CaseTimeout

    signal.signal(signal.SIGALRM, on_alarm)
    for case, args in enumerate(json.loads(cases_json)):
        try:
            signal.setitimer(signal.ITIMER_REAL, case_timeout_s)
            value = function(*args)
            signal.setitimer(signal.ITIMER_REAL, 0)
            encoded = json.dumps(value)
        except CaseTimeout:
            report(case=case, failed=f"timed out after {case_timeout_s:g} s")
            continue
        except BaseException as err:  # SystemExit, RecursionError, unserializable results...
            signal.setitimer(signal.ITIMER_REAL, 0)
            report(case=case, failed=f"raised {type(err).__name__}: {err}"[:300])
            continue
        results.write(f'{{"case": {case}, "value": {encoded}}}\n')
        results.flush()
