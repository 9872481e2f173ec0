"""A real Prometheus server scrapes a running training job; read back through its HTTP API.

The job is one the suite starts anyway (a job of its own would cost a start for what these
checks do not depend on): the long-tail test's staleness-1 run
(tests/integration/test_long_tail.py), given `ScrapedRun.settings`: two tasks on a local chat
model, prompts rendered through its template with a system turn, held-out accuracy before and
after training only (trainer.eval_every 0, the default)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tests.conftest import CHAT_SYSTEM_PROMPT
from tests.integration.prometheus_server import PrometheusServer
from tests.integration.ray_nodes import free_port


class ScrapedRun:
    """A Prometheus server scraping the job that `run` runs, with `settings` (after the job's
    own: the task list replaces the whole task section)."""

    def __init__(self, directory: Path, chat_model: str):
        self.job_port = free_port()
        self.server = PrometheusServer(directory, self.job_port)
        self.settings = [
            f"metrics.prometheus_port={self.job_port}",
            "metrics.prometheus_addr=127.0.0.1",
            f"model.path={chat_model}",
            "trainer.log_samples_every=1",
            "trainer.log_samples_shown=0",
            "task=[{name: arithmetic, label: sums, weight: 3},"
            " {name: arithmetic, label: long, options: {terms: 4}}]",
            "task.eval_size=16",
            f"task.system_prompt={CHAT_SYSTEM_PROMPT}",  # after the task list
        ]

    def run(self, job: Callable[[], object]) -> None:
        """Run `job` while reading its live series (`check` looks at them)."""
        failed = []

        def guarded():
            try:
                job()
            except BaseException as err:  # the test's thread re-raises it
                failed.append(err)

        thread = threading.Thread(target=guarded)
        thread.start()
        reward, latency, per_task, left_out = [], [], [], []
        try:
            deadline = time.monotonic() + 300
            while (
                thread.is_alive()
                and time.monotonic() < deadline
                and not (reward and latency and per_task and left_out)
            ):
                time.sleep(1)
                reward = self.server.query('groupflow_reward_mean{job="groupflow"}')
                latency = self.server.query(
                    'groupflow_stage_latency_seconds_count{stage="generation"} > 0'
                )
                per_task = self.server.query('groupflow_task_accuracy{job="groupflow"}')
                per_task = per_task if len(per_task) == 2 else []
                left_out = self.server.query('groupflow_prompts_left_out{job="groupflow"}')
        finally:
            thread.join(timeout=600)
        assert not thread.is_alive(), "the scraped job has not ended in 10 minutes"
        if failed:
            raise failed[0]
        self.live = reward, latency, per_task, left_out

    def check(self, run: Path) -> None:
        """Prometheus read the job's reward, stage latencies and per-task series, and its
        held-out accuracy before and after training, per task too."""
        reward, latency, per_task, left_out = self.live
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
        summary = json.loads((run / "summary.json").read_text())
        final, warm = summary["final_eval"], summary["warm_start_eval"]

        def last(series: str) -> dict[str, float]:
            found = self.server.query(f'last_over_time({series}{{job="groupflow"}}[10m])')
            return {s["metric"].get("task", ""): float(s["value"][1]) for s in found}

        assert last("groupflow_eval_accuracy") == {"": summary["final_accuracy"]}
        assert last("groupflow_warm_start_accuracy") == {"": summary["warm_start_accuracy"]}
        assert last("groupflow_eval_task_accuracy") == final["eval_task_accuracy"]
        tasks = {"sums", "long"}
        assert final["eval_task_accuracy"].keys() == warm["eval_task_accuracy"].keys() == tasks
        # what the engines generated from: each task's chat wording after the system turn (the
        # toy tokenizer's decode drops spaces)
        rows = [json.loads(line) for line in (run / "samples/step_1.jsonl").open()]
        assert {row["uid"].split("/")[0] for row in rows} == tasks
        assert all(
            row["prompt"].startswith(f"S({CHAT_SYSTEM_PROMPT})U(Compute".replace(" ", ""))
            for row in rows
        )

    def stop(self) -> None:
        self.server.stop()
