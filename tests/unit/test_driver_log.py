"""runs/<name>/driver.log (groupflow/observe/driver_log.py): the driver's lines from the run's start,
appended to by a resumed run, with its warnings and its failure."""

from __future__ import annotations

import io
import logging
import warnings

import pytest

from groupflow.core.errors import UserError
from groupflow.observe.driver_log import FILE_NAME, FILE_ONLY, DriverLog

log = logging.getLogger("groupflow.run.driver")


@pytest.fixture(autouse=True)
def _warning_level_root():
    """The process's logging at WARNING, as a library caller's may be (`groupflow train`
    sets INFO): the run's INFO lines reach the file all the same."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.WARNING)
    yield
    root.setLevel(level)


def _lines(run_dir) -> list[str]:
    """The file's lines less their date and time."""
    return [line.split(" ", 2)[2] for line in (run_dir / FILE_NAME).read_text().splitlines()]


def test_the_lines_before_the_run_directory_exists_are_kept_and_later_ones_follow(tmp_path):
    run_dir = tmp_path / "run"
    with DriverLog() as driver_log:
        log.info("building the quickstart model")  # before the run directory exists
        run_dir.mkdir()
        assert driver_log.open(run_dir) == run_dir / FILE_NAME
        log.warning("a reward worker is slow")
        FILE_ONLY.info("step 1/2 reward=0.500")  # what a bar shows on a terminal
    log.info("after the run")  # not the run's
    lines = _lines(run_dir)
    assert lines[0].startswith("INFO groupflow.run_log: driver started (pid ")
    assert lines[1:] == [
        "INFO groupflow.run.driver: building the quickstart model",
        "WARNING groupflow.run.driver: a reward worker is slow",
        "INFO groupflow.run_log: step 1/2 reward=0.500",
    ]


def test_the_lines_held_are_bounded(tmp_path, monkeypatch):
    import groupflow.observe.driver_log as driver_log_module

    monkeypatch.setattr(driver_log_module, "HELD_LINES", 3)
    with DriverLog() as driver_log:  # its first line, and two of the three below, are held
        for n in range(3):
            log.info("line %d", n)
        driver_log.open(tmp_path)
        log.info("after")
    lines = (tmp_path / FILE_NAME).read_text().splitlines()
    assert [line.split(" ", 2)[2] for line in lines[1:3]] == [
        "INFO groupflow.run.driver: line 0",
        "INFO groupflow.run.driver: line 1",
    ]
    assert lines[3] == "(and 1 more of the run's first lines, not kept)"
    assert lines[4].endswith("INFO groupflow.run.driver: after")


def test_a_resumed_run_appends_to_the_log(tmp_path):
    for step in (1, 2):
        with DriverLog() as driver_log:
            driver_log.open(tmp_path)
            FILE_ONLY.info("step %d/2", step)
    lines = _lines(tmp_path)
    assert [line for line in lines if "step" in line] == [
        "INFO groupflow.run_log: step 1/2",
        "INFO groupflow.run_log: step 2/2",
    ]
    assert sum("driver started" in line for line in lines) == 2


def test_file_only_lines_stay_off_the_console(tmp_path):
    console = logging.StreamHandler(io.StringIO())  # as `groupflow train` sets up stderr
    logging.getLogger().addHandler(console)
    try:
        with DriverLog() as driver_log:
            driver_log.open(tmp_path)
            FILE_ONLY.info("step 1/2 reward=0.500")
            log.info("actors up")
    finally:
        logging.getLogger().removeHandler(console)
    assert console.stream.getvalue() == "actors up\n"
    assert "step 1/2" in (tmp_path / FILE_NAME).read_text()


def test_python_warnings_go_to_the_file_and_where_they_went_before(tmp_path):
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with DriverLog() as driver_log:
            driver_log.open(tmp_path)
            warnings.warn("torch_dtype is deprecated", DeprecationWarning, stacklevel=1)
        warnings.warn("after the run", UserWarning, stacklevel=1)
    assert [str(w.message) for w in shown] == ["torch_dtype is deprecated", "after the run"]
    text = (tmp_path / FILE_NAME).read_text()
    assert "WARNING" in text and "DeprecationWarning: torch_dtype is deprecated" in text
    assert "after the run" not in text


def test_a_failed_run_ends_its_log_with_the_failure(tmp_path):
    with pytest.raises(UserError), DriverLog() as driver_log:
        driver_log.open(tmp_path)
        raise UserError("model.path: /nope is not a Hugging Face model directory")
    assert _lines(tmp_path)[-1] == (
        "ERROR groupflow.run_log: groupflow: error: model.path: /nope is not a "
        "Hugging Face model directory"
    )
    with pytest.raises(ZeroDivisionError), DriverLog() as driver_log:
        driver_log.open(tmp_path)
        1 / 0  # noqa: B018 - a bug
    text = (tmp_path / FILE_NAME).read_text()
    assert "the run failed\nTraceback" in text and text.endswith(
        "ZeroDivisionError: division by zero\n"
    )


def test_a_run_that_fails_before_its_directory_exists_writes_nothing_and_leaves_logging_as_it_was(
    tmp_path,
):
    root = logging.getLogger()
    handlers, level = (
        (list(root.handlers), list(FILE_ONLY.handlers)),
        logging.getLogger("groupflow").level,
    )
    with pytest.raises(UserError), DriverLog():
        log.info("vetting prompts")
        raise UserError("task.chat_template: refused")
    assert list(tmp_path.iterdir()) == []
    assert (root.handlers, FILE_ONLY.handlers) == handlers
    assert logging.getLogger("groupflow").level == level
