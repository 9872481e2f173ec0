"""The Prometheus gauges a job sets outside its step records (groupflow/observe/catalogue.py has
those): live counts between steps, and what the run found before its first step. The
exporter (prometheus.py) registers them and tests/unit/test_dashboard.py checks the dashboard
against them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LiveGauge:
    """A Prometheus gauge the job sets outside the step records: live counts between steps,
    and what the run found before its first step."""

    name: str
    help: str
    panel: str
    label: str | None = None  # e.g. the queue's name


LIVE_GAUGES: dict[str, LiveGauge] = {
    "engines": LiveGauge("groupflow_engines", "live generator engines", "Live actors"),
    "reward_workers": LiveGauge("groupflow_reward_workers", "live reward workers", "Live actors"),
    "learner_ranks": LiveGauge("groupflow_learner_ranks", "live learner ranks", "Live actors"),
    "pending_actors": LiveGauge(
        "groupflow_pending_actors",
        "actors a pool asked for that wait for room on the cluster (pending resource requests)",
        "Scaling",
        "pool",
    ),
    "queue_depth": LiveGauge(
        "groupflow_queue_depth", "items waiting in a queue", "Queue depths", "queue"
    ),
    # read at each scrape, so it moves while the driver waits anywhere (a lost node's
    # replacement, a learner rebuilt): the series the stalled-step alert can read directly
    "seconds_since_step": LiveGauge(
        "groupflow_seconds_since_step",
        "seconds since the job last wrote a step record (or since it started)",
        "Seconds since the last step",
    ),
    # also in summary.json; the uids are the task option skip_prompts of config.resolved.yaml
    "prompts_left_out": LiveGauge(
        "groupflow_prompts_left_out",
        "prompts left out of a dataset at the start, too long for rollout.max_model_len, by "
        "prompt source (task, mixture entry, eval set)",
        "Prompts left out",
        "source",
    ),
}
