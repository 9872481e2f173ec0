"""What `groupflow status | logs | stop | scale RUN` act on (groupflow/run/target.py), a run
directory read from disk (groupflow/run/on_disk.py) and `groupflow list`, against run
directories written here and a stand-in for the Ray Jobs client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray.job_submission

from groupflow.run import cluster_address, live
from groupflow.run import target as run_target
from groupflow.run.cli import main
from groupflow.run.live import write_cluster_file
from groupflow.run.on_disk import read_run, runs_in
from groupflow.run.target import Job, pick_job
from tests.integration.ray_nodes import free_port


def ended_pid() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(done.stdout)


def make_run(
    runs: Path,
    name: str,
    steps_done: int,
    steps: int = 8,
    summary: dict | None = None,
    checkpoints: tuple[int, ...] = (),
) -> Path:
    run = runs / name
    run.mkdir(parents=True)
    (run / "config.resolved.yaml").write_text(f"trainer:\n  steps: {steps}\n  run_name: {name}\n")
    with (run / "metrics.jsonl").open("w") as f:
        for step in range(1, steps_done + 1):
            f.write(json.dumps({"step": step, "reward_mean": 0.5}) + "\n")
        f.write('{"step": 99, "cut sh')  # a record being written is not a step
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))
    for step in checkpoints:
        (run / "checkpoints" / f"step_{step}").mkdir(parents=True)
    return run


FINISHED = {"warm_start_accuracy": 0.125, "final_accuracy": 0.40625, "steps": 8}


# ----- a run directory --------------------------------------------------------------------------
def test_the_state_of_a_run_directory(tmp_path):
    finished = read_run(make_run(tmp_path, "done", 8, summary=FINISHED, checkpoints=(4, 8)))
    assert (finished.state, finished.progress(), finished.accuracy_text()) == (
        "finished",
        "8/8",
        "0.125 -> 0.406",
    )
    assert [c.name for c in finished.checkpoints] == ["step_4", "step_8"]
    assert read_run(make_run(tmp_path, "cut", 3, summary=FINISHED)).state == "stopped"
    marked = read_run(make_run(tmp_path, "marked", 3, summary={"stopped": True}))
    assert marked.state == "stopped"
    crashed = read_run(make_run(tmp_path, "crashed", 3))
    assert (crashed.state, crashed.progress(), crashed.accuracy_text()) == ("failed", "3/8", "-")
    live_run = make_run(tmp_path, "live", 2)
    write_cluster_file(live_run, "live", "127.0.0.1:1")  # this process: a live driver
    assert read_run(live_run).state == "running"
    dead = make_run(tmp_path, "dead", 2)
    path = write_cluster_file(dead, "dead", "127.0.0.1:1")
    pid = ended_pid()
    path.write_text(json.dumps(json.loads(path.read_text()) | {"pid": pid}))
    assert read_run(dead).state == "failed"
    assert f"its driver (pid {pid}) ended without closing the run" in read_run(dead).lines()
    assert [r.name for r in runs_in(tmp_path)] == sorted(
        ["done", "cut", "marked", "crashed", "live", "dead"],
        key=lambda n: -(tmp_path / n).stat().st_mtime,
    )


# ----- which job -------------------------------------------------------------------------------
def test_a_job_is_found_by_id_else_by_run_name_running_first():
    jobs = [
        Job("raysubmit_a", "SUCCEEDED", "exp", 1),
        Job("raysubmit_b", "RUNNING", "exp", 2),
        Job("raysubmit_c", "FAILED", "exp", 3),
        Job("raysubmit_d", "STOPPED", "other", 4),
    ]
    assert pick_job("raysubmit_a", jobs).id == "raysubmit_a"
    assert pick_job("exp", jobs).id == "raysubmit_b"  # the running one
    assert pick_job("exp", jobs[:1] + jobs[2:]).id == "raysubmit_c"  # else the newest
    assert pick_job("nope", jobs) is None


class JobsAPI:
    """A cluster with submitted jobs; records what was asked of it."""

    jobs: list[SimpleNamespace] = []
    stopped: list[str] = []
    addresses: list[str] = []

    def __init__(self, address):
        JobsAPI.addresses.append(address)

    def list_jobs(self):
        return self.jobs

    def get_job_info(self, job_id):
        (job,) = [j for j in self.jobs if j.submission_id == job_id]
        return SimpleNamespace(message=f"message of {job_id}", status=job.status)

    def get_job_logs(self, job_id):
        return f"logs of {job_id}\n"

    def stop_job(self, job_id):
        JobsAPI.stopped.append(job_id)
        return True


def submitted(sid: str, run: str, status: str, start: int) -> SimpleNamespace:
    from ray.job_submission import JobStatus

    return SimpleNamespace(
        submission_id=sid,
        job_id=None,
        status=JobStatus(status),
        metadata={"groupflow_run": run},
        start_time=start,
    )


@pytest.fixture
def cluster(monkeypatch):
    monkeypatch.setattr(JobsAPI, "jobs", [submitted("raysubmit_old", "exp", "SUCCEEDED", 1)])
    monkeypatch.setattr(JobsAPI, "stopped", [])
    monkeypatch.setattr(JobsAPI, "addresses", [])
    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", JobsAPI)
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")
    return JobsAPI


@pytest.fixture
def no_cluster(monkeypatch):
    """Nothing answers at the address: a refused loopback port, through Ray's own client."""
    monkeypatch.setenv("RAY_ADDRESS", f"http://127.0.0.1:{free_port()}")


def test_logs_and_stop_take_a_run_name(cluster, monkeypatch, tmp_path, capsys):
    """stop by run name: the running job of that name (through the Jobs API here, its
    control actor refusing); an ended job is not stopped again, one line, exit 1."""
    cluster.jobs.append(submitted("raysubmit_new", "exp", "RUNNING", 2))
    assert main(["logs", "exp", "--runs", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "logs of raysubmit_new\n"
    monkeypatch.setattr(run_target, "join_address", lambda address, client: "10.0.0.5:6379")

    def refuse(target):
        raise live.LiveError(f"no control actor of run {target.run} at {target.ray_address}")

    monkeypatch.setattr(live, "connect", refuse)
    assert main(["stop", "exp", "--runs", str(tmp_path)]) == 0
    assert cluster.stopped == ["raysubmit_new"]
    capsys.readouterr()
    assert main(["stop", "raysubmit_old", "--runs", str(tmp_path)]) == 1
    assert cluster.stopped == ["raysubmit_new"]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "raysubmit_old is not running (SUCCEEDED)" in err, err
    # the address came from $RAY_ADDRESS, the dashboard's URL
    assert set(cluster.addresses) == {"http://127.0.0.1:8265"}


def test_a_run_directory_names_its_job(cluster, tmp_path, capsys):
    run = make_run(tmp_path, "exp", 8, summary=FINISHED)
    assert main(["logs", str(run)]) == 0
    assert capsys.readouterr().out == "logs of raysubmit_old\n"


def test_scale_and_status_of_a_running_job_join_the_gcs_its_dashboard_reports(
    cluster, monkeypatch, tmp_path, capsys
):
    """$RAY_ADDRESS is the dashboard's URL: the command joins the cluster at the GCS address
    derived from it (never "auto", which would make ray.init read that URL and refuse it)."""
    cluster.jobs.append(submitted("raysubmit_new", "exp", "RUNNING", 2))
    monkeypatch.setattr(
        cluster_address,
        "_node_summary",
        lambda client: [{"cmdline": ["--gcs-address=10.0.0.5:6379"]}],
    )
    monkeypatch.setattr(cluster_address, "probe", lambda address: None)
    targets = []

    def connect(target):
        targets.append(target)
        return "actor"

    monkeypatch.setattr(live, "connect", connect)
    monkeypatch.setattr(live, "print_live", lambda actor: print("engines: 1 live, target 1"))
    monkeypatch.setattr(live, "scale", lambda actor, *args, **kwargs: 0)
    assert main(["scale", "exp", "--engines", "2", "--runs", str(tmp_path)]) == 0
    assert main(["status", "exp", "--runs", str(tmp_path)]) == 0
    assert [(t.run, t.ray_address, t.job_id) for t in targets] == [
        ("exp", "10.0.0.5:6379", "raysubmit_new")
    ] * 2
    assert capsys.readouterr().out == (
        "raysubmit_new  RUNNING  run=exp\nmessage of raysubmit_new\nengines: 1 live, target 1\n"
    )


def test_status_of_an_ended_run_reads_its_directory_with_no_cluster(no_cluster, tmp_path, capsys):
    make_run(tmp_path, "quickstart", 8, summary=FINISHED, checkpoints=(4, 8))
    (tmp_path / "quickstart" / "model").mkdir()
    assert main(["status", "quickstart", "--runs", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "Failed to connect" not in out
    run = tmp_path / "quickstart"
    assert out.splitlines() == [
        "run quickstart  finished  step 8/8  held-out accuracy 0.125 -> 0.406",
        f"directory: {run}",
        f"model: {run / 'model'}",
        f"checkpoints: 2, newest {run / 'checkpoints' / 'step_8'}",
    ]


def test_status_of_a_stopped_run_says_how_to_resume(no_cluster, tmp_path, capsys):
    run = make_run(tmp_path, "cut", 4, checkpoints=(4,))
    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("run cut  failed  step 4/8  held-out accuracy -\n")
    assert f"resume: groupflow train {run / 'config.resolved.yaml'} --resume\n" in out


def test_a_run_neither_here_nor_on_the_cluster_is_one_line(no_cluster, tmp_path, capsys):
    assert main(["status", "nope", "--runs", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no run or job named nope" in err
    assert os.environ["RAY_ADDRESS"] in err and "($RAY_ADDRESS)" in err


def test_a_run_trained_here_has_no_job_to_stop_or_log(no_cluster, tmp_path, capsys):
    make_run(tmp_path, "local", 2)
    assert main(["stop", "local", "--runs", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run local is not running (failed; " in err, err
    assert main(["logs", "local", "--runs", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no Ray cluster answers at" in err, err
    (tmp_path / "local" / "driver.log").write_text("step 1/8\nstep 2/8\n")
    assert main(["logs", "local", "--runs", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "step 1/8\nstep 2/8\n"


# ----- groupflow list --------------------------------------------------------------------------
def test_list_shows_the_runs_here_and_the_jobs_on_the_cluster(cluster, tmp_path, capsys):
    make_run(tmp_path, "exp", 8, summary=FINISHED)
    os.utime(tmp_path / "exp", (1, 1))  # the older
    make_run(tmp_path, "crashed", 3)
    (tmp_path / ".exp.lock").write_text("")  # not a run
    (tmp_path / "notes").mkdir()  # nor this
    assert main(["list", "--runs", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "RUN      STATE     STEP  ACCURACY        DIRECTORY",
        f"crashed  failed    3/8   -               {tmp_path / 'crashed'}",
        f"exp      finished  8/8   0.125 -> 0.406  {tmp_path / 'exp'}",
        "",
        "JOB            STATUS     RUN",
        "raysubmit_old  SUCCEEDED  exp",
    ]


def test_list_with_no_cluster_lists_the_runs_here(no_cluster, tmp_path, capsys):
    make_run(tmp_path, "exp", 8, summary=FINISHED)
    assert main(["list", "--runs", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("exp  finished  8/8")
    assert out[2] == f"jobs: no Ray cluster answers at {os.environ['RAY_ADDRESS']} ($RAY_ADDRESS)"


def test_a_ray_error_in_the_live_part_is_shown_whole_on_one_line(cluster, monkeypatch, capsys):
    cluster.jobs.append(submitted("raysubmit_new", "exp", "RUNNING", 2))
    monkeypatch.setattr(run_target, "join_address", lambda address, client: "10.0.0.5:6379")

    def refuse(target):
        raise ValueError(
            f"Invalid Ray address: {target.ray_address!r}. To fix this, either:\n"
            "  1. Unset RAY_ADDRESS, or\n  2. Set RAY_ADDRESS to the GCS address."
        )

    monkeypatch.setattr(live, "connect", refuse)
    assert main(["status", "exp"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "live: unavailable (Invalid Ray address: '10.0.0.5:6379'. To fix this, either: "
        "1. Unset RAY_ADDRESS, or 2. Set RAY_ADDRESS to the GCS address.)"
    )
