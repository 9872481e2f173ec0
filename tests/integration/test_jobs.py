"""Ray Jobs: a head started with `ray start --head` on loopback; submit through the CLI."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_cluster(temp_dir: Path) -> None:
    """End only this cluster's processes (`ray stop` would end every cluster on the machine)."""
    procs = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(str(temp_dir) in part for part in proc.info["cmdline"] or ()):
            procs.append(proc)
    for proc in procs:
        proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=15)
    for proc in alive:
        proc.kill()


@pytest.fixture(scope="module")
def ray_head():
    # Ray keeps unix sockets under its temp dir: the path must stay short.
    temp_dir = Path(f"/tmp/gf-head-{os.getpid()}")
    dashboard = _free_port()
    # As a user with the venv activated: the job's `python` is the one with groupflow.
    # The head runs with Ray's token auth and a token of its own, as a shared cluster should;
    # the client sends it (nothing depends on a token left in ~/.ray by earlier runs).
    venv_bin = str(Path(sys.executable).parent)
    gcs_port = _free_port()
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "PATH": f"{venv_bin}:{os.environ['PATH']}",
        # `groupflow scale/status` join the cluster here (other clusters may run on this
        # machine, so `auto` could not tell which)
        "GROUPFLOW_RAY_ADDRESS": f"127.0.0.1:{gcs_port}",
    }
    ray = str(Path(venv_bin) / "ray")
    subprocess.run(
        [
            ray,
            "start",
            "--head",
            f"--port={gcs_port}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard}",
            f"--ray-client-server-port={_free_port()}",
            f"--dashboard-agent-listen-port={_free_port()}",
            "--num-cpus=8",
            "--disable-usage-stats",
            f"--temp-dir={temp_dir}",
        ],
        env=env,
        check=True,
        capture_output=True,
        timeout=180,
    )
    yield f"http://127.0.0.1:{dashboard}", env
    _stop_cluster(temp_dir)
    shutil.rmtree(temp_dir, ignore_errors=True)


def _groupflow(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "groupflow.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def _first_step(metrics: Path, timeout_s: float = 300) -> None:
    """Wait until the job has written its first step (polling the file: each `groupflow`
    process would take CPU from the job on a small machine)."""
    deadline = time.monotonic() + timeout_s
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert time.monotonic() < deadline, "the submitted job wrote no step"
        time.sleep(0.5)


def test_submitted_quickstart_succeeds_and_scales(ray_head, quickstart_model, tmp_path):
    """Submitted, found by run name and by job id while it runs, its reward workers scaled
    from 2 to 3 (each step in metrics.jsonl once, with the workers that served it)."""
    address, env = ray_head
    proc = _groupflow(
        [
            "submit",
            "--no-follow",
            "--address",
            address,
            "--set",
            "trainer.steps=8",
            "--set",
            "task.eval_size=16",
            "--set",
            f"trainer.output_dir={tmp_path}",
        ],
        env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    job_id = proc.stdout.splitlines()[0].strip()
    metrics = tmp_path / "quickstart" / "metrics.jsonl"
    _first_step(metrics)
    scale = _groupflow(["scale", job_id, "--address", address, "--reward-workers", "3"], env)
    assert scale.returncode == 0, scale.stderr[-2000:]
    assert "reward workers: 2 -> 3" in scale.stdout
    scaled_at = len(metrics.read_text().splitlines())
    # by run name, through the Jobs API (no local run directory of that name is looked at)
    live = _groupflow(
        ["status", "quickstart", "--address", address, "--runs", str(tmp_path / "none")], env
    ).stdout
    assert f"{job_id}  RUNNING  run=quickstart" in live
    assert "reward workers: 3 live, target 3" in live and "learner ranks: 2" in live
    zero = _groupflow(["scale", "quickstart", "--address", address, "--engines", "0"], env)
    assert (zero.returncode, zero.stderr.count("\n")) == (2, 1)
    follow = _groupflow(["logs", job_id, "--follow", "--address", address], env)
    assert follow.returncode == 0
    status = _groupflow(["status", job_id, "--address", address], env)
    assert "SUCCEEDED" in status.stdout
    assert (tmp_path / "quickstart" / "summary.json").is_file()
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    workers = [r["num_reward_workers"] for r in records]
    assert workers[0] == 2 and workers[-1] == 3 and sorted(workers) == workers, workers
    assert workers.index(3) <= scaled_at + 1, (workers, scaled_at)
    # an ended job: one line, exit 1, naming its state
    ended = _groupflow(["scale", job_id, "--address", address, "--reward-workers", "2"], env)
    assert ended.returncode == 1
    assert ended.stderr == f"groupflow: error: job {job_id} is not running (SUCCEEDED)\n"


def test_a_config_that_fails_on_the_cluster_ends_failed_with_its_error(ray_head, tmp_path):
    address, env = ray_head
    proc = _groupflow(
        [
            "submit",
            "--address",
            address,
            "--set",
            "model.path=/nonexistent/model",
            "--set",
            f"trainer.output_dir={tmp_path}",
        ],
        env,
    )
    assert proc.returncode == 1
    assert "FAILED" in proc.stderr
    job_id = proc.stdout.splitlines()[0].strip()
    logs = _groupflow(["logs", job_id, "--address", address], env)
    assert "model.path: /nonexistent/model is not a Hugging Face model directory" in logs.stdout


def test_a_bad_key_is_refused_before_submission(tmp_path):
    proc = _groupflow(
        ["submit", "--address", "http://127.0.0.1:9", "--set", "learner.lr=1"], dict(os.environ)
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["groupflow: error: learner.lr: unknown key"]
