"""What the tests hold the exporter, the dashboard, the alert rules and the plots to: the
dashboard's rows, and every series name as a PromQL query spells it."""

from __future__ import annotations

from groupflow.observe.catalogue import METRICS, Series
from groupflow.observe.live_gauges import LIVE_GAUGES

# Grafana panel -> its dashboard row (the layout users expect).
PANEL_ROWS = {
    "Reward": "Progress",
    "Accuracy": "Progress",
    "Response length": "Progress",
    "Step and policy version": "Progress",
    "Learning rate": "Progress",
    "Entropy": "Token credit",
    "Spurious and low-probability tokens": "Token credit",
    "Cancellation residual": "Token credit",
    "Clip fractions": "Token credit",
    "Approx. KL": "Token credit",
    "Gradient norm and log-prob mismatch": "Token credit",
    "Off-policy correction": "Token credit",
    "Tokens per second by stage": "Throughput",
    "Mean stage latency and step time": "Throughput",
    "Staleness": "Throughput",
    "Queue depths": "Throughput",
    "Live actors": "Cluster",
    "Reward errors and timeouts": "Cluster",
    "Checkpoints": "Cluster",
    "Restarts": "Cluster",
    "Actor memory": "Cluster",
    "Scaling": "Cluster",
    "Weight sync": "Cluster",
    "Prompts left out": "Cluster",
    "Seconds since the last step": "Cluster",
    "Turns per trajectory": "Agents",
    "Tool use and observation share": "Agents",
    "Tool calls, errors and timeouts": "Agents",
    "Trajectory end reasons": "Agents",
    "Expert load balance": "Mixture of experts",
    "Routing disagreement": "Mixture of experts",
}

# Panels that stay empty unless the job (or the scrape config) has a feature: each says which
# when it has no data (its "noValue" text names this setting).
AGENTS = "agent.tools"
RAY_SCRAPE = "deploy/prometheus.yml"
FEATURE_PANELS = {
    "Turns per trajectory": AGENTS,
    "Tool use and observation share": AGENTS,
    "Tool calls, errors and timeouts": AGENTS,
    "Tool latency p50 / p95": AGENTS,
    "Trajectory end reasons": AGENTS,
    "Checkpoints": "trainer.checkpoint_every",
    "Ray nodes: CPU and GPU use": RAY_SCRAPE,
    "Actors by node": RAY_SCRAPE,
    "Object store traffic by node": RAY_SCRAPE,
    "Object store memory by node": RAY_SCRAPE,
    "Expert load balance": "mixture-of-experts models only",
    "Routing disagreement": "mixture-of-experts jobs with routing replay only",
}


def promql_name(series: Series) -> str:
    """A series' name as a PromQL query spells it: counters with _total, histograms by their
    base name."""
    return f"{series.name}_total" if series.kind in ("counter", "running_total") else series.name


# Every metric name as a query spells it, so the dashboard can be checked against what the
# exporter emits.
EXPORTED_METRICS: frozenset[str] = frozenset(
    [promql_name(m.series) for m in METRICS if m.series is not None]
    + [g.name for g in LIVE_GAUGES.values()]
)
