"""A Prometheus endpoint for one training job (prometheus-client, its own registry).

The exporter lives in the driver process. Metrics produced by actors on other nodes reach it
without Ray's metrics system: every generator, reward worker and learner rank returns its
figures to the driver in its step results, the driver folds them into the step record
(`groupflow.metrics.step_metrics`, then `Trainer.train`), and `observe_step` exports that
record. One process therefore owns every series of a job, and the Prometheus target is the
head node (where a Ray job's driver runs) at `metrics.prometheus_port`. Ray's own per-node
metrics (CPU, GPU, object store) are scraped separately; see deploy/prometheus.yml.

Every series carries a `job` label with the run name (`trainer.run_name`). Prometheus sets
its own `job` label on scrape, so the scrape config uses `honor_labels: true` to keep ours.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# Step-record key -> (gauge name, help). Keys absent from a record leave their gauge unchanged.
RECORD_GAUGES: dict[str, tuple[str, str]] = {
    "step": ("groupflow_step", "last completed training step"),
    "policy_version": ("groupflow_policy_version", "policy version the engines sample from"),
    "reward_mean": ("groupflow_reward_mean", "mean sequence reward of the step's samples"),
    "reward_std": ("groupflow_reward_std", "standard deviation of the step's rewards"),
    "accuracy": ("groupflow_accuracy", "fraction of the step's samples with full reward"),
    "eval_accuracy": ("groupflow_eval_accuracy", "held-out greedy accuracy (when evaluated)"),
    "response_len_mean": ("groupflow_response_length_mean", "mean response length in tokens"),
    "entropy_mean": ("groupflow_entropy_mean", "mean token entropy of the responses"),
    "entropy_pos": ("groupflow_entropy_pos", "mean token entropy, positive-advantage samples"),
    "entropy_neg": ("groupflow_entropy_neg", "mean token entropy, negative-advantage samples"),
    "spurious_frac": ("groupflow_spurious_frac", "fraction of tokens flagged spurious (STAPO)"),
    "lowprob_frac": ("groupflow_lowprob_frac", "fraction of low-probability tokens"),
    "lowprob_grad_share": (
        "groupflow_lowprob_grad_share",
        "share of the gradient norm from low-probability tokens",
    ),
    "cancellation_residual": (
        "groupflow_cancellation_residual",
        "residual of token-gradient cancellation within groups",
    ),
    "clip_frac_low": ("groupflow_clip_frac_low", "fraction of tokens clipped at 1 - eps_low"),
    "clip_frac_high": ("groupflow_clip_frac_high", "fraction of tokens clipped at 1 + eps_high"),
    "approx_kl": ("groupflow_approx_kl", "approximate KL between old and current policy"),
    "grad_norm": ("groupflow_grad_norm", "gradient norm before clipping"),
    "logp_mismatch_mean": (
        "groupflow_logp_mismatch_mean",
        "mean |vLLM logprob - learner logprob| per token",
    ),
    "staleness_mean": ("groupflow_staleness_mean", "mean policy versions behind, trained samples"),
    "staleness_max": ("groupflow_staleness_max", "largest policy lag among trained samples"),
    "time_step_s": ("groupflow_step_duration_seconds", "wall time of the last step"),
}

# Step-record time key -> `stage` label of the latency histogram.
STAGE_TIMES: dict[str, str] = {
    "time_gen_s": "generation",
    "time_reward_s": "reward",
    "time_learn_s": "learning",
    "time_sync_s": "weight_sync",
}

# Step-record keys holding running totals -> counter name (exposed with the _total suffix).
RUNNING_TOTALS: dict[str, tuple[str, str]] = {
    "reward_errors": (
        "groupflow_reward_errors",
        "reward scoring errors (the verifier raised or returned garbage)",
    ),
    "reward_timeouts": ("groupflow_reward_timeouts", "reward scoring timeouts"),
}

STAGE_LATENCY = "groupflow_stage_latency_seconds"
TOKENS_PER_SECOND = "groupflow_tokens_per_second"
TOKENS_GENERATED = "groupflow_tokens_generated"
QUEUE_DEPTH = "groupflow_queue_depth"
CLUSTER_GAUGES: dict[str, tuple[str, str]] = {
    "engines": ("groupflow_engines", "live generator engines"),
    "reward_workers": ("groupflow_reward_workers", "live reward workers"),
    "learner_ranks": ("groupflow_learner_ranks", "live learner ranks"),
}

# From a few milliseconds (reward scoring of a small batch) to minutes (generation on an LLM).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300, 600)

# Every metric name as a PromQL query spells it (counters with _total, histograms by their
# base name), so the dashboard can be checked against what the exporter emits.
EXPORTED_METRICS: frozenset[str] = frozenset(
    [name for name, _ in RECORD_GAUGES.values()]
    + [name for name, _ in CLUSTER_GAUGES.values()]
    + [f"{name}_total" for name, _ in RUNNING_TOTALS.values()]
    + [f"{TOKENS_GENERATED}_total", TOKENS_PER_SECOND, STAGE_LATENCY, QUEUE_DEPTH]
)


def _counter_increment(previous: float, total: float) -> float:
    """How much a running total grew; a total that went down was restarted from zero."""
    return total - previous if total >= previous else total


class PrometheusExporter:
    """Serves one job's metrics over HTTP at `addr:port` (port 0 = any free port, see .port).

    The default address is every interface because Prometheus usually scrapes from another
    host; pass "127.0.0.1" to keep the endpoint local.
    """

    def __init__(self, job: str, port: int, addr: str = "0.0.0.0"):
        self.job = job
        self.registry = CollectorRegistry()
        self._gauges = {
            key: Gauge(name, doc, ["job"], registry=self.registry)
            for key, (name, doc) in RECORD_GAUGES.items()
        }
        self._cluster = {
            key: Gauge(name, doc, ["job"], registry=self.registry)
            for key, (name, doc) in CLUSTER_GAUGES.items()
        }
        self._totals = {
            key: Counter(name, doc, ["job"], registry=self.registry)
            for key, (name, doc) in RUNNING_TOTALS.items()
        }
        self._last_totals: dict[str, float] = {key: 0.0 for key in RUNNING_TOTALS}
        self._tokens = Counter(
            TOKENS_GENERATED, "response tokens generated", ["job"], registry=self.registry
        )
        self._tokens_per_s = Gauge(
            TOKENS_PER_SECOND,
            "tokens per second of the last step, by stage",
            ["job", "stage"],
            registry=self.registry,
        )
        self._latency = Histogram(
            STAGE_LATENCY,
            "time spent in each stage of a step",
            ["job", "stage"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._queue = Gauge(
            QUEUE_DEPTH, "items waiting in a queue", ["job", "queue"], registry=self.registry
        )
        # prometheus_client's metrics are thread-safe; this guards the running totals, should
        # step records ever arrive from more than one thread.
        self._lock = threading.Lock()
        self._server, self._thread = start_http_server(port, addr, registry=self.registry)

    @property
    def port(self) -> int:
        """The bound port (the one the OS chose when asked for port 0)."""
        return self._server.server_address[1]

    def observe_step(self, record: dict) -> None:
        """Export one step record (the object written to metrics.jsonl)."""
        with self._lock:
            for key, gauge in self._gauges.items():
                if key in record:
                    gauge.labels(self.job).set(record[key])
            for key, stage in STAGE_TIMES.items():
                if key in record:
                    self._latency.labels(self.job, stage).observe(record[key])
            self._observe_tokens(record)
            self._observe_totals(record)

    def _observe_tokens(self, record: dict) -> None:
        if "gen_tokens_per_s" in record:
            self._tokens_per_s.labels(self.job, "generation").set(record["gen_tokens_per_s"])
        tokens = record.get("tokens_generated")
        if tokens is None:
            return
        self._tokens.labels(self.job).inc(tokens)
        if record.get("time_learn_s"):
            # The learner trains on every response token of the step once.
            self._tokens_per_s.labels(self.job, "learning").set(tokens / record["time_learn_s"])

    def _observe_totals(self, record: dict) -> None:
        for key, counter in self._totals.items():
            if key in record:
                total = float(record[key])
                counter.labels(self.job).inc(_counter_increment(self._last_totals[key], total))
                self._last_totals[key] = total

    def set_cluster(self, engines: int, reward_workers: int, learner_ranks: int) -> None:
        """Live actor counts (they change when pools are scaled or workers replaced)."""
        counts = {
            "engines": engines,
            "reward_workers": reward_workers,
            "learner_ranks": learner_ranks,
        }
        for key, value in counts.items():
            self._cluster[key].labels(self.job).set(value)

    def set_queue_depth(self, name: str, depth: int) -> None:
        """Items waiting in the named queue (e.g. "generation", "reward")."""
        self._queue.labels(self.job, name).set(depth)

    def close(self) -> None:
        """Stop serving and free the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
