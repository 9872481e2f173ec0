"""The Grafana dashboard queries only metrics the exporter emits, in the rows users expect."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from groupflow.observe.catalogue import METRICS
from groupflow.observe.live_gauges import LIVE_GAUGES
from tests.unit.dashboard_spec import EXPORTED_METRICS, FEATURE_PANELS, PANEL_ROWS, promql_name

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "groupflow.json"
METRIC = re.compile(r"groupflow_[a-z_]+")
HISTOGRAM_SERIES = re.compile(r"_(bucket|sum|count)$")

# A catalogue unit -> the Grafana unit of a panel drawing it (others: "short").
GRAFANA_UNITS = {"fraction": "percentunit", "seconds": "s", "bytes": "bytes"}


def catalogue_panels() -> dict[str, set[str]]:
    """Catalogue panel -> the metrics (as PromQL names them) it must query."""
    panels: dict[str, set[str]] = {}
    for m in METRICS:
        if m.series is not None and m.panel is not None:
            panels.setdefault(m.panel, set()).add(promql_name(m.series))
    for g in LIVE_GAUGES.values():
        panels.setdefault(g.panel, set()).add(g.name)
    return panels


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


def panels_by_title(dashboard: dict) -> dict[str, dict]:
    return {p["title"]: p for p in flat_panels(dashboard) if p["type"] != "row"}


@pytest.mark.parametrize("panel", sorted(catalogue_panels()))
def test_catalogue_panel_sits_in_its_row_and_queries_its_metrics(dashboard, panel):
    row = PANEL_ROWS[panel]
    rows = panels_by_row(dashboard)
    assert row in rows, f"no row {row!r}; rows: {sorted(rows)}"
    titles = {p["title"]: p for p in rows[row]}
    assert panel in titles, f"row {row!r} has no panel {panel!r}; it has {sorted(titles)}"
    missing = catalogue_panels()[panel] - metric_names(expressions([titles[panel]]))
    assert not missing, f"panel {panel!r} does not query {sorted(missing)}"


def test_every_catalogue_panel_has_a_row():
    panels = {m.panel for m in METRICS if m.panel} | {g.panel for g in LIVE_GAUGES.values()}
    assert panels <= PANEL_ROWS.keys(), sorted(panels - PANEL_ROWS.keys())


def test_panel_units_follow_the_catalogue(dashboard):
    by_title = panels_by_title(dashboard)
    for m in METRICS:
        if m.series is not None and m.panel is not None:
            unit = by_title[m.panel]["fieldConfig"]["defaults"].get("unit", "short")
            assert unit == GRAFANA_UNITS.get(m.unit, "short"), (m.key, m.panel, unit)


def test_latency_quantiles_come_from_the_buckets(dashboard):
    quantiles = [e for e in expressions(flat_panels(dashboard)) if "histogram_quantile" in e]
    assert any("groupflow_stage_latency_seconds_bucket" in e for e in quantiles)
    assert any("groupflow_tool_latency_seconds_bucket" in e for e in quantiles)
    for expr in quantiles:
        assert re.search(r"groupflow_[a-z_]+_seconds_bucket", expr), expr
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


@pytest.mark.parametrize("title", sorted(FEATURE_PANELS))
def test_a_panel_that_needs_a_feature_says_so_when_empty(dashboard, title):
    no_value = panels_by_title(dashboard)[title]["fieldConfig"]["defaults"].get("noValue", "")
    assert FEATURE_PANELS[title] in no_value, (title, no_value)


def test_held_out_accuracy_is_drawn_from_before_training_on(dashboard):
    """Measured before and after training whatever trainer.eval_every is, so the headline
    panel draws the held-out series beside the training samples' (not only with eval_every)."""
    accuracy = metric_names(expressions([panels_by_title(dashboard)["Accuracy"]]))
    assert {"groupflow_eval_accuracy", "groupflow_warm_start_accuracy"} <= accuracy
    assert "groupflow_eval_task_accuracy" in accuracy  # each task of a mixture
