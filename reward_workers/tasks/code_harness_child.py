"""Runs inside the sandbox: load the model's solution and call it on each test input.

reward_workers/tasks/code_tests.py appends a call `run(...)` to this file's text and runs the
result with reward_workers.sandbox; it is never imported. Each outcome is one JSON line on
the original stdout, {"case": i, "value": ...} or {"case": i, "failed": "..."}; anything the
solution prints goes to stderr. The expected outputs never enter the sandbox (the parent
compares), so a solution cannot report itself as passing.

The solution shares this interpreter, so whatever the harness needs once it runs is out of
the solution's reach, as the sandbox's audit hook is (reward_workers/sandbox/child.py): the
functions that load, call and report run with no globals and no builtins, and take their
state as positional defaults (an immutable tuple) of C functions and classes taken before the
solution runs. A solution that rewrites this module's globals (a traceback's frames hold
them), patches `json`, `os`, `signal` or `builtins`, or signals itself before its first case
breaks nothing here; only its own results can be wrong.
"""

import builtins
import json
import os
import signal
import sys
import types
from _json import encode_basestring_ascii, make_encoder


class CaseTimeout(BaseException):  # not an Exception: a solution's `except Exception` misses it
    pass


def _frozen(function, *defaults):
    """`function`'s code with `defaults` as its trailing positional defaults and no globals
    or builtins: a name it does not take from its arguments raises NameError."""
    return types.FunctionType(function.__code__, {"__builtins__": {}}, function.__name__, defaults)


def _on_alarm(_signum, _frame, timeout):
    raise timeout


def _unserializable(value, prims):
    type_, type_name, type_error = prims
    raise type_error(f"Object of type {type_name(type_(value))} is not JSON serializable")


def _to_json(value, prims):
    encoder_of, unserializable, text_encoder, join = prims
    # a fresh encoder per value: a failed encoding leaves its circular-reference marks behind
    return join(
        "",
        encoder_of({}, unserializable, text_encoder, None, ": ", ", ", False, False, True)(
            value, 0
        ),
    )


def _describe(err, prims):
    type_, type_name, str_, base = prims
    try:
        name = type_name(type_(err))
    except base:
        name = "an exception"
    try:
        return f"{name}: {str_(err)}"[:300]
    except base:  # an exception whose str() raises
        return name


def _report(line, prims):
    write, fd, encode = prims
    data = encode(line)
    while data:
        data = data[write(fd, data) :]


def _run(solution, entry_point, cases, case_timeout_s, prims):
    compile_, exec_, get, callable_, enumerate_, setitimer, timer, timeout, base = prims[:9]
    to_json, describe, report, builtins_ = prims[9:]
    namespace = {"__name__": "solution", "__builtins__": builtins_}
    try:
        exec_(compile_(solution, "solution.py", "exec"), namespace)
    except base as err:  # a solution that fails to load fails every test
        report('{"load_error": ' + to_json(describe(err)) + "}\n")
        return
    function = get(namespace, entry_point)
    if not callable_(function):
        report('{"load_error": ' + to_json("no function named " + entry_point) + "}\n")
        return
    for case, args in enumerate_(cases):
        try:
            setitimer(timer, case_timeout_s)
            value = function(*args)
            setitimer(timer, 0)
            encoded = to_json(value)
        except timeout:
            report(f'{{"case": {case}, "failed": "timed out after {case_timeout_s:g} s"}}\n')
            continue
        except base as err:  # SystemExit, RecursionError, unserializable results...
            setitimer(timer, 0)
            report(f'{{"case": {case}, "failed": ' + to_json("raised " + describe(err)) + "}\n")
            continue
        report(f'{{"case": {case}, "value": {encoded}}}\n')


def run(solution: str, entry_point: str, cases_json: str, case_timeout_s: float) -> None:
    results = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    type_name = type.__dict__["__name__"].__get__  # a metaclass cannot override it
    unserializable = _frozen(_unserializable, (type, type_name, TypeError))
    to_json = _frozen(_to_json, (make_encoder, unserializable, encode_basestring_ascii, str.join))
    describe = _frozen(_describe, (type, type_name, str, BaseException))
    report = _frozen(_report, (os.write, results, str.encode))
    # installed before the solution runs: a SIGALRM it sends itself never kills the harness
    signal.signal(signal.SIGALRM, _frozen(_on_alarm, CaseTimeout))
    prims = (compile, exec, dict.get, callable, enumerate, signal.setitimer, signal.ITIMER_REAL)
    prims += (CaseTimeout, BaseException, to_json, describe, report, builtins)
    _frozen(_run, prims)(solution, entry_point, json.loads(cases_json), case_timeout_s)
