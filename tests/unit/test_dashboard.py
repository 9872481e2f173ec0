"""The Grafana dashboard queries only metrics the exporter emits, in the rows users expect."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from groupflow.prometheus import EXPORTED_METRICS

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "groupflow.json"
METRIC = re.compile(r"groupflow_[a-z_]+")
HISTOGRAM_SERIES = re.compile(r"_(bucket|sum|count)$")

# Row title -> metrics (as PromQL names them) that some panel of the row must query.
ROWS = {
    "Progress": {
        "groupflow_reward_mean",
        "groupflow_accuracy",
        "groupflow_response_length_mean",
    },
    "Token credit": {
        "groupflow_entropy_mean",
        "groupflow_entropy_pos",
        "groupflow_entropy_neg",
        "groupflow_spurious_frac",
        "groupflow_cancellation_residual",
        "groupflow_clip_frac_low",
        "groupflow_clip_frac_high",
        "groupflow_approx_kl",
    },
    "Throughput": {
        "groupflow_tokens_per_second",
        "groupflow_stage_latency_seconds",
        "groupflow_staleness_mean",
        "groupflow_queue_depth",
    },
    "Cluster": {
        "groupflow_engines",
        "groupflow_reward_workers",
        "groupflow_learner_ranks",
        "groupflow_reward_errors_total",
        "groupflow_reward_timeouts_total",
    },
}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def flat_panels(dashboard: dict) -> list[dict]:
    """Panels in layout order; a collapsed row keeps its panels inside it."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def expressions(panels: list[dict]) -> list[str]:
    return [t["expr"] for p in panels for t in p.get("targets", []) if t.get("expr")]


def metric_names(exprs: list[str]) -> set[str]:
    return {HISTOGRAM_SERIES.sub("", name) for e in exprs for name in METRIC.findall(e)}


def panels_by_row(dashboard: dict) -> dict[str, list[dict]]:
    rows: dict[str, list[dict]] = {}
    current = None
    for panel in flat_panels(dashboard):
        if panel["type"] == "row":
            current = rows.setdefault(panel["title"], [])
        elif current is not None:
            current.append(panel)
    return rows


def template_queries(dashboard: dict) -> list[str]:
    out = []
    for var in dashboard["templating"]["list"]:
        query = var.get("query")
        out.append(query.get("query", "") if isinstance(query, dict) else str(query))
    return out


def test_every_queried_metric_is_exported(dashboard):
    queried = metric_names(expressions(flat_panels(dashboard)) + template_queries(dashboard))
    assert queried, "the dashboard queries no groupflow metric"
    assert queried <= EXPORTED_METRICS, sorted(queried - EXPORTED_METRICS)


def test_every_exported_metric_is_on_the_dashboard(dashboard):
    assert EXPORTED_METRICS <= metric_names(expressions(flat_panels(dashboard)))


@pytest.mark.parametrize("row", sorted(ROWS))
def test_row_exists_with_its_metrics(dashboard, row):
    rows = panels_by_row(dashboard)
    assert row in rows, f"no row {row!r}; rows: {sorted(rows)}"
    assert rows[row], f"row {row!r} has no panels"
    missing = ROWS[row] - metric_names(expressions(rows[row]))
    assert not missing, f"row {row!r} does not query {sorted(missing)}"


def test_stage_latency_quantiles_come_from_the_buckets(dashboard):
    quantiles = [e for e in expressions(flat_panels(dashboard)) if "histogram_quantile" in e]
    assert quantiles
    for expr in quantiles:
        assert "groupflow_stage_latency_seconds_bucket" in expr
        assert re.search(r"\ble\b", expr), f"{expr}: must keep the le label"


def test_job_variable_filters_every_groupflow_query(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert "job" in variables
    assert "groupflow_" in variables["job"]["query"]["query"]
    for expr in expressions(flat_panels(dashboard)):
        if METRIC.search(expr):
            assert '$job"' in expr, f"{expr}: not filtered by the job variable"


def test_panels_use_the_datasource_variable(dashboard):
    for panel in flat_panels(dashboard):
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


def test_panel_ids_are_unique(dashboard):
    ids = [p["id"] for p in flat_panels(dashboard)]
    assert len(ids) == len(set(ids))
