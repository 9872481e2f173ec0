"""Ray Jobs: a head started with `ray start --head` on loopback; submit through the CLI."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from groupflow.loop.pipeline import HEARTBEAT_S
from tests.integration.prometheus_server import PrometheusServer
from tests.integration.ray_nodes import FAST_HEALTH_CHECKS, RayNode, free_port
from tests.integration.test_presets import (
    ON_SUBMITTED_JOB,
    check_preset_run,
    preset_settings,
)

pytestmark = pytest.mark.integration
ALERTS = Path(__file__).resolve().parents[2] / "deploy" / "alerts.yml"


@pytest.fixture(scope="module")
def ray_head():
    # As a user with the venv activated: the job's `python` is the one with groupflow.
    # The head runs with Ray's token auth and a token of its own, as a shared cluster should;
    # the client sends it (nothing depends on a token left in ~/.ray by earlier runs).
    venv_bin = str(Path(sys.executable).parent)
    gcs_port, dashboard = free_port(), free_port()
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "PATH": f"{venv_bin}:{os.environ['PATH']}",
    }
    env.pop("RAY_ADDRESS", None)
    head = RayNode(
        [
            "--head",
            f"--port={gcs_port}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard}",
            f"--ray-client-server-port={free_port()}",
            "--num-cpus=8",
        ],
        {**env, **FAST_HEALTH_CHECKS},
        "head",
    )
    yield f"http://127.0.0.1:{dashboard}", env, f"127.0.0.1:{gcs_port}"
    head.stop()


def _groupflow(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "groupflow.run.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def _groupflows(*commands: list[str], env: dict) -> list[subprocess.CompletedProcess]:
    """`groupflow` commands that do not depend on each other, side by side: each is mostly a
    process importing Ray on one core while the job trains."""
    with ThreadPoolExecutor(max_workers=len(commands)) as pool:
        return list(pool.map(lambda args: _groupflow(args, env), commands))


def test_a_bad_key_is_refused_before_submission(tmp_path):
    proc = _groupflow(
        ["submit", "--address", "http://127.0.0.1:9", "--set", "learner.lr=1"], dict(os.environ)
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["groupflow: error: learner.lr: unknown key"]


def _scrape(port: int) -> dict[str, float]:
    """The job's exporter, `name{labels}` -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
        text = page.read().decode()
    series = (line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("groupflow_"))
    return {name: float(value) for name, value in series}


def _alerting(prometheus: PrometheusServer, alert: str, pool: str) -> bool:
    return any(
        a["labels"]["alertname"] == alert and a["labels"].get("pool") == pool
        for a in prometheus.firing()
    )


# More steps than the job can reach before the test stops it, however busy the machine: with
# 30, a job that ran fast while the CLI commands (each importing Ray) ran slowly ended on its
# own before `status` and `stop` reached it. The stop ends it; the LR schedule barely moves.
SUBMITTED_STEPS = 100_000


def test_a_submitted_job_scales_loses_its_engines_node_and_stops(
    ray_head, quickstart_model, tmp_path
):
    """One submitted job (its start is most of the cost), found by run name and by job id
    while it runs; beside its start, a config that fails on the cluster ends FAILED and
    `groupflow logs` shows its error. Its reward workers are scaled from 2 to 3 (each step in
    metrics.jsonl once, with the workers that served it). Then both its engines, on a node of their own, are lost
    mid-job: the job says which engines it lost and that it waits for them, its live series
    and `groupflow status` move while the step waits (engines pending, none live, seconds
    since the last step rising; a real Prometheus with deploy/alerts.yml sees the pool below
    its target), and once a node with room joins, the replacements take the current weights
    and generate the steps after. Then `groupflow stop` stops it through its control actor: it
    finishes the step in flight, saves a checkpoint (off schedule: checkpoint_every is beyond
    the job's steps), the model, plots and summary.json, and the command prints what was
    written; every step is in metrics.jsonl once, and one restart per engine lost. The cluster address is RAY_ADDRESS set to the
    dashboard's URL, as Ray's docs tell users, and nothing else: scale, status and stop join
    the GCS address the dashboard reports."""
    address, head_env, gcs = ray_head
    env = {**head_env, "RAY_ADDRESS": address}
    engines_node = [f"--address={gcs}", "--num-cpus=0", '--resources={"gf_engines": 2}']
    port = free_port()
    overrides = {
        "trainer.steps": SUBMITTED_STEPS,
        "trainer.output_dir": tmp_path,
        "trainer.checkpoint_every": SUBMITTED_STEPS + 1,
        "task.eval_size": 8,
        # a stopped job ends without its final evaluation: one every other step instead, so
        # that the replacements answer one
        "trainer.eval_every": 2,
        # the 16 prompts a step of a preset's run: micro-batches of 96 tokens make a step's
        # cost grow with its tokens, and nothing here depends on how many there are
        "rollout.prompts_per_step": 16,
        "rollout.num_engines": 2,
        "rollout.resources.num_cpus": 0,  # the engines node has no CPU: nothing else goes there
        "rollout.resources.custom": "{gf_engines: 1}",
        "metrics.prometheus_port": port,
        "metrics.prometheus_addr": "127.0.0.1",
    }
    # STAPO and DAPO with their riders (two learner ranks, wandb offline; DAPO's dynamic
    # sampling through a lost node, too)
    settings = [f"{key}={value}" for key, value in overrides.items()]
    settings += preset_settings(*ON_SUBMITTED_JOB)
    # deploy/alerts.yml as shipped, but firing at once rather than after its `for:` periods
    rules = tmp_path / "alerts.yml"
    rules.write_text(re.sub(r"\bfor: \w+", "for: 0s", ALERTS.read_text()))
    prometheus = PrometheusServer(tmp_path, port, rules)
    run = tmp_path / "quickstart"
    metrics, log_path = run / "metrics.jsonl", run / "driver.log"
    nodes = []

    def driver_log() -> str:
        return log_path.read_text() if log_path.is_file() else ""

    def wait_for(condition, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, driver_log()[-4000:]
            time.sleep(0.5)

    def steps() -> list[int]:
        lines = metrics.read_text().splitlines() if metrics.is_file() else []
        return [json.loads(line)["step"] for line in lines if line.endswith("}")]

    elsewhere = ["--runs", str(tmp_path / "none")]
    beside = ThreadPoolExecutor(max_workers=1)
    try:
        proc = _groupflow(
            ["submit", "--no-follow", *[arg for s in settings for arg in ("--set", s)]], env
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
        job_id = proc.stdout.splitlines()[0].strip()
        # A config that fails on the cluster (the address given with --address), submitted
        # while the job starts: it ends FAILED with its error
        failing = beside.submit(
            _groupflow,
            [
                "submit",
                "--address",
                address,
                "--set",
                "model.path=/nonexistent/model",
                "--set",
                f"trainer.output_dir={tmp_path / 'failed'}",
                "--set",
                "trainer.run_name=failed",
            ],
            env,
        )
        # The engines' node joins while the driver starts (its engines wait to be placed)
        nodes.append(RayNode(engines_node, head_env, "engines"))
        wait_for(lambda: len(steps()) >= 1, 300)
        failed = failing.result()
        assert failed.stdout, failed.stderr[-2000:]  # its first line: the job id
        # by run name, through the Jobs API (no local run directory of that name is looked at)
        scale, failed_logs = _groupflows(
            ["scale", "quickstart", *elsewhere, "--reward-workers", "3"],
            ["logs", failed.stdout.splitlines()[0].strip(), "--address", address],
            env=env,
        )
        assert scale.returncode == 0, scale.stderr[-2000:]
        assert "reward workers: 2 -> 3" in scale.stdout
        scaled_at = len(steps())

        nodes[0].kill()
        wait_for(lambda: "no engine is left: generation waits for it" in driver_log(), 60)
        lost_at = len(steps())
        before = _scrape(port)
        # while the step waits for its engines
        live, listed, zero = _groupflows(
            ["status", "quickstart", *elsewhere],
            ["list", "--runs", str(tmp_path)],
            ["scale", job_id, "--engines", "0"],
            env=env,
        )
        # the seconds since the last step rise by a heartbeat (polled: the commands above
        # usually took longer than that already)
        since = 'groupflow_seconds_since_step{job="quickstart"}'
        wait_for(lambda: _scrape(port)[since] >= before[since] + HEARTBEAT_S, 60)
        during = _scrape(port)
        assert during['groupflow_pending_actors{job="quickstart",pool="engines"}'] == 2
        assert during['groupflow_engines{job="quickstart"}'] == 0
        wait_for(lambda: "replacement has waited" in driver_log(), 60)
        wait_for(lambda: _alerting(prometheus, "GroupflowPoolBelowTarget", "engines"), 60)
        nodes.append(RayNode(engines_node, head_env, "engines2"))
        # a step generated by the replacements alone: the one after the step in flight
        wait_for(lambda: len(steps()) >= lost_at + 2, 300)
        # `logs --follow` beside it: it follows the job until the job ends
        stop, follow = _groupflows(
            ["stop", "quickstart", *elsewhere],
            ["logs", "quickstart", "--follow", *elsewhere],
            env=env,
        )
    finally:  # (a job left running ends with the module's head, this file's last test)
        beside.shutdown()
        prometheus.stop()
        for node in nodes:
            node.stop()
    assert failed.returncode == 1 and "FAILED" in failed.stderr, failed.stdout + failed.stderr
    error = "model.path: /nonexistent/model is not a Hugging Face model directory"
    assert error in failed_logs.stdout, failed_logs.stdout[-2000:] + failed_logs.stderr[-2000:]
    assert f"{job_id}  RUNNING  run=quickstart" in live.stdout, live.stdout + live.stderr
    assert "reward workers: 3 live, target 3" in live.stdout and "learner ranks: 2" in live.stdout
    assert "engines: 0 live, target 2 (2 pending: no room on the cluster)" in live.stdout
    assert re.search(r"^quickstart +running ", listed.stdout, re.M), listed.stdout
    assert re.search(rf"^{job_id} +RUNNING +quickstart$", listed.stdout, re.M), listed.stdout
    assert (zero.returncode, zero.stderr.count("\n")) == (2, 1)
    assert stop.returncode == 0, stop.stdout[-2000:] + stop.stderr[-2000:]
    said = stop.stdout.splitlines()
    assert said[0].startswith("stop requested: the job finishes its step in flight"), said
    at = re.escape(str(run))
    stopped = re.fullmatch(
        rf"stopped at step (\d+) of {SUBMITTED_STEPS} \(groupflow stop\): wrote checkpoint "
        rf"{at}/checkpoints/step_(\d+), model {at}/model, plots and summary\.json in {at}; "
        r"resume with: groupflow submit CONFIG .*",
        said[-1],
    )
    assert stopped and stopped[1] == stopped[2], said
    reached = int(stopped[1])
    assert follow.returncode == 0, follow.stdout[-2000:]
    # ended: the Jobs API's state, and what the run directory holds; and an ended job
    # refuses to scale
    after, ended = _groupflows(
        ["status", "quickstart", "--runs", str(tmp_path)],
        ["scale", job_id, "--reward-workers", "2"],
        env=env,
    )
    status = after.stdout
    assert f"{job_id}  SUCCEEDED  run=quickstart" in status
    assert (
        f"run quickstart  stopped  step {reached}/{SUBMITTED_STEPS}  held-out accuracy " in status
    )
    assert f"model: {run / 'model'}" in status
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["stopped"], summary["step_reached"]) == (True, reached)
    assert summary["stopped_by"] == "groupflow stop"
    assert (run / "model" / "config.json").is_file() and (run / "reward.png").is_file()
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, reached + 1)) and reached < SUBMITTED_STEPS
    workers = [r["num_reward_workers"] for r in records]
    assert workers[0] == 2 and workers[-1] == 3 and sorted(workers) == workers, workers
    assert workers.index(3) <= scaled_at + 1, (workers, scaled_at)
    # an ended job: one line, exit 1, naming its state
    assert ended.returncode == 1
    assert ended.stderr == f"groupflow: error: job {job_id} is not running (SUCCEEDED)\n"
    log = driver_log()
    assert records[-1]["engine_restarts"] == 2, log[-4000:]
    assert log.count("a replacement is asked for") == 2
    waited = [line for line in log.splitlines() if "replacement has waited" in line]
    assert waited and "it asks {gf_engines: 1}" in waited[0]
    assert "no gf_engines" in waited[0]  # what the cluster has once the node is gone
    assert log.count("replacement is up") == 2
    # the replacements answered a held-out evaluation (at an even step after the loss)
    evaluated = [r["eval_accuracy"] for r in records[lost_at:] if "eval_accuracy" in r]
    assert evaluated and all(0.0 <= a <= 1.0 for a in evaluated), records[lost_at:]
    for preset in ON_SUBMITTED_JOB:
        check_preset_run(preset, records, run)
