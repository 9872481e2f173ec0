"""deploy/alerts.yml: Prometheus loads it (deploy/prometheus.yml), promtool accepts it, each
rule fires on synthetic series of a job in trouble and stays quiet on a healthy one
(tests/unit/alerts_test.yml), and every rule queries only series the job exports."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.unit.dashboard_spec import EXPORTED_METRICS

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "alerts.yml"


@pytest.fixture(scope="module")
def promtool() -> str:
    binary = shutil.which("promtool")
    assert binary, "promtool is not installed (make test installs Debian's prometheus package)"
    return binary


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_prometheus_loads_the_rules_and_promtool_accepts_them(promtool):
    done = _run(promtool, "check", "config", "deploy/prometheus.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "deploy/alerts.yml" in done.stdout and "11 rules found" in done.stdout


def test_each_rule_fires_on_trouble_and_not_on_a_healthy_job(promtool):
    done = _run(promtool, "test", "rules", "tests/unit/alerts_test.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    tested = set(re.findall(r"alertname: (\w+)", (ROOT / "tests/unit/alerts_test.yml").read_text()))
    assert tested == set(alert_names())


def alert_names() -> list[str]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule["alert"] for group in groups for rule in group["rules"]]


def test_every_rule_queries_only_what_the_job_exports():
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    for rule in (r for g in groups for r in g["rules"]):
        names = set(re.findall(r"\bgroupflow_\w+", rule["expr"]))
        assert names and names <= EXPORTED_METRICS, (rule["alert"], names - EXPORTED_METRICS)
