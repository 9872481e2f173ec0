"""The run directory (groupflow/run/directory.py, groupflow/run/driver.py): a fresh one keeps the earlier run, a live run's
name is held, a resume is checked whole before the directory is touched, and what cannot be
written is one line naming the path."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from groupflow.config import ConfigError
from groupflow.core.errors import RunError
from groupflow.loop.checkpoint import CheckpointStore
from groupflow.run.directory import claim_run_name, fresh_run_dir
from groupflow.run.driver import check_resume, prepare_run_dir, read_resume
from groupflow.run.job_config import build_config


def test_an_earlier_run_is_kept_under_a_new_name(tmp_path):
    run = tmp_path / "quickstart"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    assert fresh_run_dir(run) == run
    assert list(run.iterdir()) == []
    (kept,) = [p for p in tmp_path.iterdir() if p != run]
    assert (
        kept.name.startswith("quickstart.")
        and (kept / "metrics.jsonl").read_text() == '{"step": 1}\n'
    )


def test_two_earlier_runs_kept_in_the_same_second_are_both_kept(tmp_path):
    run = tmp_path / "job"
    for step in (1, 2):
        run.mkdir(exist_ok=True)
        (run / "metrics.jsonl").write_text(f'{{"step": {step}}}\n')
        os.utime(run, (0, 0))  # the same stamp both times
        fresh_run_dir(run)
    kept = sorted(p.read_text() for p in tmp_path.glob("job.*/metrics.jsonl"))
    assert kept == ['{"step": 1}\n', '{"step": 2}\n']


def test_a_new_or_empty_directory_is_used_as_it_is(tmp_path):
    run = tmp_path / "a" / "b"
    assert fresh_run_dir(run) == run and run.is_dir()
    assert fresh_run_dir(run) == run and list(tmp_path.joinpath("a").iterdir()) == [run]


@pytest.mark.parametrize("name", ["", ".", "..", "../elsewhere", "a/b", "/abs", ".hidden", "a\\b"])
def test_a_run_name_is_one_plain_directory_name(name):
    with pytest.raises(ConfigError) as err:
        build_config({"trainer": {"run_name": name}}, [])
    assert str(err.value).startswith("trainer.run_name:") and "\n" not in str(err.value)


# ----- a live run's name is held ---------------------------------------------------------------
def test_a_live_runs_name_is_refused_to_a_second_job_and_freed_when_it_ends(tmp_path):
    live = claim_run_name(tmp_path, "job")  # the live run's driver
    run = tmp_path / "job"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(RunError) as err:
        claim_run_name(tmp_path, "job")  # a second job's, another open file of the lock
    message = str(err.value)
    assert message.startswith("trainer.run_name:") and f"pid {os.getpid()}" in message
    assert "\n" not in message and [p.name for p in tmp_path.iterdir() if p.is_dir()] == ["job"]
    os.close(live)  # the live run ends (or dies: the kernel closes its files)
    os.close(claim_run_name(tmp_path, "job"))
    claim_run_name(tmp_path, "other")  # other names were never held


def _driver_record(run: Path, pid: int, host: str) -> None:
    record = {"run": run.name, "gcs_address": "127.0.0.1:6379", "pid": pid, "host": host}
    (run / "cluster.json").write_text(json.dumps(record))


def _ended_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("host", ["here", "elsewhere"])
def test_a_live_drivers_record_refuses_the_name_even_without_its_lock(tmp_path, host):
    """Round 3: the lock file gone (or a driver on another host, whose flock is not seen
    here), a second start renamed the live run's directory from under its driver."""
    run = tmp_path / "job"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    _driver_record(run, os.getppid(), socket.gethostname() if host == "here" else "node-7")
    with pytest.raises(RunError) as err:
        claim_run_name(tmp_path, "job")
    message = str(err.value)
    assert message.startswith(f"trainer.run_name: {run} belongs to a run still training (pid ")
    assert "\n" not in message and ("remove" in message) == (host == "elsewhere")
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == ["job"]
    assert (run / "metrics.jsonl").is_file()
    claim_run_name(tmp_path, "other")  # the refused start let the lock go


def test_the_record_of_a_driver_that_ended_frees_the_name(tmp_path):
    run = tmp_path / "job"
    run.mkdir()
    _driver_record(run, _ended_pid(), socket.gethostname())
    os.close(claim_run_name(tmp_path, "job"))


@pytest.mark.parametrize("make", ["a file", "under a file"])
def test_an_unusable_output_dir_is_one_line_naming_it(tmp_path, make):
    (tmp_path / "f").write_text("")
    output_dir = tmp_path / "f" if make == "a file" else tmp_path / "f" / "runs"
    with pytest.raises(RunError) as err:
        claim_run_name(output_dir, "job")
    message = str(err.value)
    assert message.startswith("trainer.output_dir:") and str(output_dir) in message
    assert "\n" not in message


def test_a_run_directory_that_cannot_be_made_is_one_line_naming_it(tmp_path):
    cfg = build_config({}, [])
    (tmp_path / "job").write_text("not a directory")
    with pytest.raises(RunError) as err:
        prepare_run_dir(cfg, tmp_path / "job", None)
    assert str(tmp_path / "job") in str(err.value) and "\n" not in str(err.value)
    assert (tmp_path / "job").read_text() == "not a directory"


# ----- a resume is checked whole before the run directory is touched ---------------------------
def _model(tmp_path: Path) -> str:
    from tests.unit.test_checkpoint import MODEL

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MODEL))
    return str(model)


def _edit_state(checkpoint: Path, **changes) -> None:
    state_file = checkpoint / "driver_state.json"
    state_file.write_text(json.dumps(json.loads(state_file.read_text()) | changes))


def find_resume(cfg, run: Path, model_path: str):
    """What a run does with `trainer.resume` before it touches the run directory: the
    checkpoint read (once), then checked against the job."""
    resume = read_resume(cfg, CheckpointStore(run))
    check_resume(cfg, resume, model_path)
    return resume


def _hostile(kind: str, tmp_path: Path, run: Path) -> Path:
    from tests.unit.test_checkpoint import save

    checkpoint = save(CheckpointStore(run), 2)
    if kind == "negative step":
        _edit_state(checkpoint, step=-5)
    elif kind == "step past trainer.steps":
        _edit_state(checkpoint, step=10**30)
    elif kind == "another run's checkpoint":
        checkpoint = save(CheckpointStore(tmp_path / "runs" / "other"), 9)
    elif kind == "a symlinked checkpoint of another run":
        other = save(CheckpointStore(tmp_path / "runs" / "other"), 9)
        (run / "checkpoints" / "step_9").symlink_to(other)
        checkpoint = run / "checkpoints" / "step_9"
    elif kind == "a crafted shard":
        (checkpoint / "learner" / "rng_rank_0.pt").write_bytes(b"cos\nsystem\n(S'true'\ntR.")
    return checkpoint


@pytest.mark.parametrize(
    "kind",
    [
        "negative step",
        "step past trainer.steps",
        "another run's checkpoint",
        "a symlinked checkpoint of another run",
        "a crafted shard",
    ],
)
def test_a_refused_resume_leaves_the_run_directory_as_it_was(tmp_path, kind):
    run = tmp_path / "runs" / "job"
    checkpoint = _hostile(kind, tmp_path, run)
    (run / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in range(1, 6)))
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    cfg = build_config(
        {"trainer": {"resume": str(checkpoint), "steps": 20}}, ["learner.num_ranks=2"]
    )
    with pytest.raises(RunError) as err:
        find_resume(cfg, run, _model(tmp_path))
    assert "\n" not in str(err.value)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_a_checked_resume_rewinds_the_metrics(tmp_path):
    run = tmp_path / "runs" / "job"
    checkpoint = _hostile("none", tmp_path, run)
    (run / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in range(1, 6)))
    cfg = build_config({"trainer": {"resume": str(checkpoint)}}, ["learner.num_ranks=2"])
    resume = find_resume(cfg, run, _model(tmp_path))
    assert prepare_run_dir(cfg, run, resume) == run
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'


class _RayJoined(Exception):
    """Where the test stops a run: everything before Ray is done."""


def test_a_resume_reads_the_checkpoints_driver_state_once(tmp_path, monkeypatch):
    """`groupflow train --resume` up to joining Ray: the finished-run check, the checks
    against the job and the rewind of the run directory read the checkpoint's driver state
    once, through the run's one store."""
    import groupflow.run.driver
    from groupflow.run.cli import main

    run = tmp_path / "runs" / "job"
    checkpoint = _hostile("none", tmp_path, run)
    (run / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in range(1, 6)))
    model = _model(tmp_path)
    reads = []
    read_text = Path.read_text

    def counted(path: Path, *args, **kwargs) -> str:
        if path.name == "driver_state.json":
            reads.append(path)
        return read_text(path, *args, **kwargs)

    def joined(*args, **kwargs):
        raise _RayJoined

    monkeypatch.setattr(Path, "read_text", counted)
    checked = SimpleNamespace(model_path=model, prompts=SimpleNamespace(left_out={}))
    monkeypatch.setattr(groupflow.run.driver, "check_inputs", lambda cfg: checked)
    monkeypatch.setattr(groupflow.run.driver, "join_ray", joined)
    monkeypatch.setattr(groupflow.run.driver.ray, "is_initialized", lambda: False)
    overrides = [f"trainer.output_dir={tmp_path / 'runs'}", "trainer.run_name=job"]
    overrides += ["trainer.steps=20", "learner.num_ranks=2", f"model.path={model}"]
    with pytest.raises(_RayJoined):
        main(["train", *[x for o in overrides for x in ("--set", o)], "--resume"])
    assert reads == [checkpoint / "driver_state.json"]
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'  # rewound
