"""A Prometheus endpoint for one training job (prometheus-client, its own registry).

The exporter lives in the driver process. Metrics produced by actors on other nodes reach it
without Ray's metrics system: every generator, reward worker and learner rank returns its
figures to the driver in its step results, the job loop folds them into the step record
(`groupflow.loop.job.TrainingJob`), and `observe_step` exports that record. One process therefore owns every series of a job, and the Prometheus target is the
head node (where a Ray job's driver runs) at `metrics.prometheus_port`. Ray's own per-node
metrics (CPU, GPU, object store) are scraped separately; see deploy/prometheus.yml.

Held-out scores are exported as they are measured: before training, at each evaluation, and
after training (`observe_held_out`); a job that ends waits for one more scrape, when something
scrapes it, so that the final scores are read before the endpoint goes (`await_scrape`).

Every series carries a `job` label with the run name (`trainer.run_name`). Prometheus sets
its own `job` label on scrape, so the scrape config uses `honor_labels: true` to keep ours.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from groupflow.config import Config
from groupflow.core.errors import RunError
from groupflow.observe.catalogue import FAMILY_HELP, METRICS, Series
from groupflow.observe.live_gauges import LIVE_GAUGES

log = logging.getLogger(__name__)

# The longest a finished job waits for a scraper to read its final scores: twice the interval
# seen between its scrapes, at most this (and this when only one scrape was seen).
MAX_FINAL_SCRAPE_WAIT_S = 60.0

# From a few milliseconds (reward scoring of a small batch) to minutes (generation on an LLM).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300, 600)

_METRIC_CLASSES = {
    "gauge": Gauge,
    "counter": Counter,
    "running_total": Counter,
    "histogram": Histogram,
}


class ScrapeClock:
    """When the endpoint was last scraped (the last two times)."""

    def __init__(self):
        self.times: list[float] = []
        self.changed = threading.Condition()

    def note(self) -> None:
        with self.changed:
            self.times = [*self.times[-1:], time.monotonic()]
            self.changed.notify_all()

    def wait_for_scrape_after(self, moment: float) -> bool:
        """Wait for a scrape that starts after `moment` (when the endpoint has been scraped
        before, for at most twice the interval seen, capped); whether one came."""
        with self.changed:
            if not self.times:
                return False  # nothing scrapes this job
            interval = self.times[-1] - self.times[0] if len(self.times) > 1 else None
            wait = (
                min(2 * interval, MAX_FINAL_SCRAPE_WAIT_S) if interval else MAX_FINAL_SCRAPE_WAIT_S
            )
            return self.changed.wait_for(lambda: self.times[-1] > moment, timeout=wait)


def _counter_increment(previous: float, total: float) -> float:
    """How much a running total grew; a total that went down was restarted from zero."""
    return total - previous if total >= previous else total


class PrometheusExporter:
    """Serves one job's metrics over HTTP at `addr:port` (port 0 = any free port, see .port).

    The series are the catalogue's (groupflow/observe/catalogue.py). The default address is every
    interface because Prometheus usually scrapes from another host; pass "127.0.0.1" to keep
    the endpoint local.
    """

    def __init__(self, job: str, port: int, addr: str = "0.0.0.0"):
        self.job = job
        self.registry = CollectorRegistry()
        # The live gauges first: the registry reads its metrics in this order, so a scrape is
        # noted (seconds_since_step) before it reads any score.
        self._live = {
            key: Gauge(
                g.name,
                g.help,
                ["job"] if g.label is None else ["job", g.label],
                registry=self.registry,
            )
            for key, g in LIVE_GAUGES.items()
        }
        self._scrapes = ScrapeClock()
        self._step_at = time.monotonic()
        self._held_out_at = 0.0  # when held-out scores were last set
        self._live["seconds_since_step"].labels(job).set_function(self._seconds_since_step)
        families: dict[str, object] = {}
        self._series = []  # (record key, series, its family)
        for metric in METRICS:
            series = metric.series
            if series is not None:
                if series.name not in families:
                    families[series.name] = self._family(series, metric.help)
                self._series.append((metric.key, series, families[series.name]))
        self._last_totals: dict[str, float] = {}
        # prometheus_client's metrics are thread-safe; this guards the running totals, should
        # step records ever arrive from more than one thread.
        self._lock = threading.Lock()
        self._server, self._thread = start_http_server(port, addr, registry=self.registry)

    def _seconds_since_step(self) -> float:
        """Read at every scrape, which it notes."""
        self._scrapes.note()
        return time.monotonic() - self._step_at

    def _family(self, series: Series, help_text: str):
        labels = ["job"]
        if series.stage is not None:
            labels.append("stage")
        if series.label is not None:
            labels.append(series.label)
        extra = {"buckets": LATENCY_BUCKETS} if series.kind == "histogram" else {}
        return _METRIC_CLASSES[series.kind](
            series.name,
            FAMILY_HELP.get(series.name, help_text),
            labels,
            registry=self.registry,
            **extra,
        )

    @property
    def port(self) -> int:
        """The bound port (the one the OS chose when asked for port 0)."""
        return self._server.server_address[1]

    def observe_step(self, record: dict) -> None:
        """Export one step record (the object written to metrics.jsonl); keys absent from
        the record leave their series unchanged."""
        self._step_at = time.monotonic()
        self._observe(record)

    def observe_held_out(self, scores: dict) -> None:
        """Export held-out scores measured outside a step (before and after training), under
        the step records' keys (eval_*, warm_start_accuracy)."""
        self._observe(scores)
        self._held_out_at = time.monotonic()  # a scrape that starts later reads them

    def await_scrape(self) -> bool:
        """Wait until a scrape has read the newest held-out scores, if anything scrapes this
        endpoint (at most MAX_FINAL_SCRAPE_WAIT_S); whether one did."""
        return self._scrapes.wait_for_scrape_after(self._held_out_at)

    def _observe(self, record: dict) -> None:
        with self._lock:
            for key, series, family in self._series:
                if key not in record:
                    continue
                if series.label is not None:  # one series per label value
                    for label_value, value in record[key].items():
                        child = family.labels(self.job, str(label_value))
                        if series.kind == "counter":
                            child.inc(float(value))
                        else:
                            child.set(float(value))
                    continue
                # A series appears on its first value, not as a 0 before the job has one.
                child = family.labels(self.job, *([series.stage] if series.stage else []))
                if series.kind == "histogram" and isinstance(record[key], list):
                    for value in record[key]:  # one observation each (tool_latency_s)
                        child.observe(float(value))
                    continue
                value = float(record[key])
                if series.kind == "gauge":
                    child.set(value)
                elif series.kind == "counter":
                    child.inc(value)
                elif series.kind == "running_total":
                    child.inc(_counter_increment(self._last_totals.get(key, 0.0), value))
                    self._last_totals[key] = value
                else:
                    child.observe(value)

    def set_cluster(self, engines: int, reward_workers: int, learner_ranks: int) -> None:
        """Live actor counts (they change when pools are scaled or workers replaced)."""
        self._live["engines"].labels(self.job).set(engines)
        self._live["reward_workers"].labels(self.job).set(reward_workers)
        self._live["learner_ranks"].labels(self.job).set(learner_ranks)

    def set_pending(self, pool: str, count: int) -> None:
        """Actors of a pool ("engines", "reward_workers") waiting for room on the cluster."""
        self._live["pending_actors"].labels(self.job, pool).set(count)

    def set_prompts_left_out(self, counts: Mapping[str, int]) -> None:
        """Prompts each source (task, mixture entry, eval set) left out at vetting."""
        for source, count in counts.items():
            self._live["prompts_left_out"].labels(self.job, source).set(count)

    def set_queue_depth(self, name: str, depth: int) -> None:
        """Items waiting in the named queue (e.g. "generation", "reward")."""
        self._live["queue_depth"].labels(self.job, name).set(depth)

    def close(self) -> None:
        """Stop serving and free the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve_metrics(cfg: Config) -> PrometheusExporter | None:
    """The job's endpoint at `metrics.prometheus_port` (none when unset); a port that cannot
    be served is one line naming the key."""
    m = cfg.metrics
    if m.prometheus_port is None:
        return None
    try:
        exporter = PrometheusExporter(cfg.trainer.run_name, m.prometheus_port, m.prometheus_addr)
    except OSError as err:
        raise RunError(
            f"metrics.prometheus_port: cannot serve on "
            f"{m.prometheus_addr}:{m.prometheus_port} ({err.strerror})"
        ) from None
    log.info("Prometheus metrics on http://%s:%d/metrics", m.prometheus_addr, exporter.port)
    return exporter
