"""A real Prometheus server scrapes a running training job; read back through its HTTP API."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request

import pytest

from groupflow.cli import main
from tests.conftest import CHAT_SYSTEM_PROMPT

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _query(prom_port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{prom_port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as reply:
        body = json.load(reply)
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.fixture
def prometheus(tmp_path):
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed (make test installs Debian's package)"
    job_port, prom_port = _free_port(), _free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: groupflow\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{job_port}']}}]\n"
    )
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    yield job_port, prom_port
    proc.terminate()
    proc.wait(timeout=30)


def test_prometheus_reads_reward_and_stage_latency(prometheus, ray_cluster, chat_model, tmp_path):
    """A job of two tasks on a local chat model (prompts rendered through its template, with a
    system turn): Prometheus reads its reward, stage latencies and per-task series."""
    job_port, prom_port = prometheus
    codes = []
    job = threading.Thread(
        target=lambda: codes.append(
            main(
                [
                    "train",
                    "--set",
                    f"metrics.prometheus_port={job_port}",
                    "--set",
                    "metrics.prometheus_addr=127.0.0.1",
                    "--set",
                    f"trainer.output_dir={tmp_path}",
                    "--set",
                    "trainer.run_name=prom",
                    "--set",
                    "trainer.steps=8",
                    "--set",  # the chat prompts are ten times the quickstart's: fewer a step
                    "rollout.prompts_per_step=8",
                    "--set",
                    f"model.path={chat_model}",
                    "--set",
                    "trainer.log_samples_every=1",
                    "--set",
                    "trainer.log_samples_shown=0",
                    "--set",
                    "task=[{name: arithmetic, label: sums, weight: 3},"
                    " {name: arithmetic, label: long, options: {terms: 4}}]",
                    "--set",
                    "task.eval_size=16",
                    "--set",  # after the task list, which replaces the whole task section
                    f"task.system_prompt={CHAT_SYSTEM_PROMPT}",
                ]
            )
        )
    )
    job.start()
    reward, latency, per_task, left_out = [], [], [], []
    deadline = time.monotonic() + 300
    while (
        job.is_alive()
        and time.monotonic() < deadline
        and not (reward and latency and per_task and left_out)
    ):
        time.sleep(1)
        reward = _query(prom_port, 'groupflow_reward_mean{job="groupflow"}')
        latency = _query(prom_port, 'groupflow_stage_latency_seconds_count{stage="generation"} > 0')
        per_task = _query(prom_port, 'groupflow_task_accuracy{job="groupflow"}')
        per_task = per_task if len(per_task) == 2 else []
        left_out = _query(prom_port, 'groupflow_prompts_left_out{job="groupflow"}')
    job.join(timeout=600)
    assert codes == [0]
    assert reward and 0.0 <= float(reward[0]["value"][1]) <= 1.0
    assert latency and float(latency[0]["value"][1]) > 0
    assert latency[0]["metric"]["stage"] == "generation"
    assert {series["metric"]["task"] for series in per_task} == {"sums", "long"}
    assert all(0.0 <= float(series["value"][1]) <= 1.0 for series in per_task)
    # set once before the first step: the built-in tasks have no rows to leave out
    assert {s["metric"]["source"]: float(s["value"][1]) for s in left_out} == {
        "task sums": 0.0,
        "task long": 0.0,
    }
    # what the engines generated from: each task's chat wording after the system turn (the toy
    # tokenizer's decode drops spaces)
    rows = [json.loads(line) for line in (tmp_path / "prom/samples/step_1.jsonl").open()]
    assert {row["uid"].split("/")[0] for row in rows} == {"sums", "long"}
    assert all(
        row["prompt"].startswith(f"S({CHAT_SYSTEM_PROMPT})U(Compute".replace(" ", ""))
        for row in rows
    )
