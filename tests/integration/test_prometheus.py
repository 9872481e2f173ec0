"""A real Prometheus server scrapes a running training job; read back through its HTTP API."""

from __future__ import annotations

import json
import threading
import time

import pytest

from groupflow.run.cli import main
from tests.conftest import CHAT_SYSTEM_PROMPT
from tests.integration.prometheus_server import PrometheusServer
from tests.integration.ray_nodes import free_port

pytestmark = pytest.mark.integration


@pytest.fixture
def prometheus(tmp_path):
    job_port = free_port()
    server = PrometheusServer(tmp_path, job_port)
    yield job_port, server
    server.stop()


def test_prometheus_reads_reward_and_stage_latency(prometheus, ray_cluster, chat_model, tmp_path):
    """A job of two tasks on a local chat model (prompts rendered through its template, with a
    system turn): Prometheus reads its reward, stage latencies and per-task series, and with
    trainer.eval_every 0 its held-out accuracy before and after training, per task too."""
    job_port, server = prometheus
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
                    "trainer.steps=4",
                    "--set",  # the chat prompts are ten times the quickstart's: fewer a step
                    "rollout.prompts_per_step=8",
                    "--set",  # nothing here depends on how many ranks learn
                    "learner.num_ranks=1",
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
        reward = server.query('groupflow_reward_mean{job="groupflow"}')
        latency = server.query('groupflow_stage_latency_seconds_count{stage="generation"} > 0')
        per_task = server.query('groupflow_task_accuracy{job="groupflow"}')
        per_task = per_task if len(per_task) == 2 else []
        left_out = server.query('groupflow_prompts_left_out{job="groupflow"}')
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
    # Held-out scores with eval_every 0 (the default): before training and after; the job
    # waited for a scrape of the final ones before its endpoint went (a range query: the
    # series went stale with the endpoint).
    summary = json.loads((tmp_path / "prom/summary.json").read_text())
    final, warm = summary["final_eval"], summary["warm_start_eval"]

    def last(series: str) -> dict[str, float]:
        found = server.query(f'last_over_time({series}{{job="groupflow"}}[10m])')
        return {s["metric"].get("task", ""): float(s["value"][1]) for s in found}

    assert last("groupflow_eval_accuracy") == {"": summary["final_accuracy"]}
    assert last("groupflow_warm_start_accuracy") == {"": summary["warm_start_accuracy"]}
    assert last("groupflow_eval_task_accuracy") == final["eval_task_accuracy"]
    assert (
        final["eval_task_accuracy"].keys()
        == warm["eval_task_accuracy"].keys()
        == {
            "sums",
            "long",
        }
    )
    # what the engines generated from: each task's chat wording after the system turn (the toy
    # tokenizer's decode drops spaces)
    rows = [json.loads(line) for line in (tmp_path / "prom/samples/step_1.jsonl").open()]
    assert {row["uid"].split("/")[0] for row in rows} == {"sums", "long"}
    assert all(
        row["prompt"].startswith(f"S({CHAT_SYSTEM_PROMPT})U(Compute".replace(" ", ""))
        for row in rows
    )
