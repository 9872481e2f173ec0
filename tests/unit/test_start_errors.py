"""An actor that fails while it starts is said in one line: its own error and its node
(groupflow/core/start_errors.py), read from reports shaped as Ray writes them, around tracebacks
raised here."""

from __future__ import annotations

import random
import string
import traceback

from groupflow.core.start_errors import own_error, start_failure

ERRORS = [FileNotFoundError, ImportError, ValueError, RuntimeError, MemoryError, OSError]


def raised(rng: random.Random) -> tuple[str, str]:
    """A real traceback of a random error with a random message (its lines include
    indented code and a chained error), and the error's own line."""
    error = rng.choice(ERRORS)
    message = "".join(rng.choices(string.ascii_letters + " /:'._-", k=rng.randint(1, 40)))
    message = message.strip() or "x"

    def load(path):
        raise error(f"{path}: {message}")

    try:
        try:
            {}["missing"]
        except KeyError:
            load("/models/" + message[:5])
    except error:
        text = traceback.format_exc()
    return text, f"{error.__name__}: /models/{message[:5]}: {message}"


def ray_report(rng: random.Random, text: str, ip: str) -> str:
    """Ray's report of an actor that died in its creation task, colours included."""
    return (
        "The actor died because of an error raised in its creation task, "
        f"\x1b[36mray::Generator.__init__()\x1b[39m (pid={rng.randint(2, 99999)}, ip={ip}, "
        f"actor_id={rng.randbytes(16).hex()}, repr=<Generator object>)\n" + text
    )


def test_the_actors_own_error_and_its_node_make_the_line():
    rng = random.Random()
    for _ in range(100):
        text, own = raised(rng)
        ip = ".".join(str(rng.randint(0, 255)) for _ in range(4))
        report = ray_report(rng, text, ip)
        assert own_error(report) == own
        what = rng.choice(["engine", "reward worker", "learner rank"])
        line = start_failure(what, report)
        article = "an" if what == "engine" else "a"
        assert line == f"{article} {what} failed to start on node {ip}: {own}"
        assert "\n" not in line


def test_a_report_with_no_traceback_keeps_its_first_line():
    report = (
        "The actor is dead because its worker process has died. Worker exit type: "
        "SYSTEM_ERROR\nWorker exit detail: the node ran out of memory"
    )
    assert start_failure("engine", report) == (
        "an engine failed to start: The actor is dead because its worker process has died. "
        "Worker exit type: SYSTEM_ERROR"
    )
