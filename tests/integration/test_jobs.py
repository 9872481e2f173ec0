"""Ray Jobs: a head started with `ray start --head` on loopback; submit through the CLI."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
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
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "PATH": f"{venv_bin}:{os.environ['PATH']}",
    }
    ray = str(Path(venv_bin) / "ray")
    subprocess.run(
        [
            ray,
            "start",
            "--head",
            f"--port={_free_port()}",
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


def test_submitted_quickstart_succeeds(ray_head, quickstart_model, tmp_path):
    address, env = ray_head
    proc = _groupflow(
        [
            "submit",
            "--address",
            address,
            "--set",
            "trainer.steps=2",
            "--set",
            "task.eval_size=16",
            "--set",
            f"trainer.output_dir={tmp_path}",
        ],
        env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "SUCCEEDED" in proc.stderr
    job_id = proc.stdout.splitlines()[0].strip()
    status = _groupflow(["status", job_id, "--address", address], env)
    assert "SUCCEEDED" in status.stdout
    assert (tmp_path / "quickstart" / "summary.json").is_file()


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
