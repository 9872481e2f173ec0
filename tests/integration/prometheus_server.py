"""A real Prometheus server for the integration tests: it scrapes one job's exporter every
second and, given a rules file, evaluates its alerts every second; read back through its
HTTP API."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

from tests.integration.ray_nodes import free_port


class PrometheusServer:
    def __init__(self, directory: Path, job_port: int, rules: Path | None = None):
        binary = shutil.which("prometheus")
        assert binary, "prometheus is not installed (make test installs Debian's package)"
        self.port = free_port()
        config = directory / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            + (f"rule_files: ['{rules}']\n" if rules is not None else "")
            + "scrape_configs:\n"
            "  - job_name: groupflow\n"
            f"    static_configs: [{{targets: ['127.0.0.1:{job_port}']}}]\n"
        )
        self.process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def _get(self, path: str) -> dict:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}"
        with urllib.request.urlopen(url, timeout=5) as reply:
            body = json.load(reply)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self._get("query?" + urllib.parse.urlencode({"query": expr}))["result"]

    def firing(self) -> list[dict]:
        """The alerts firing now, each with its labels."""
        return [a for a in self._get("alerts")["alerts"] if a["state"] == "firing"]

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
