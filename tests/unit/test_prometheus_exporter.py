"""The Prometheus exporter, scraped over HTTP on loopback and parsed as Prometheus would."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from groupflow.observe.prometheus import PrometheusExporter
from tests.unit.dashboard_spec import EXPORTED_METRICS

STEP_1 = {
    "step": 1,
    "policy_version": 1,
    "reward_mean": 0.25,
    "accuracy": 0.2,
    "response_len_mean": 7.5,
    "entropy_mean": 0.6,
    "entropy_pos": 0.5,
    "entropy_neg": 0.7,
    "spurious_frac": 0.01,
    "lowprob_frac": 0.3,
    "lowprob_grad_share": 0.8,
    "cancellation_residual": 0.9,
    "clip_frac_low": 0.02,
    "clip_frac_high": 0.03,
    "approx_kl": 0.001,
    "grad_norm": 1.5,
    "tokens_generated": 600,
    "gen_tokens_per_s": 200.0,
    "learn_tokens_per_s": 1000.0,
    "time_gen_s": 3.0,
    "time_reward_s": 0.02,
    "time_learn_s": 0.6,
    "time_sync_s": 0.08,
    "time_step_s": 3.8,
    "staleness_mean": 0.0,
    "staleness_max": 0,
    "reward_errors": 1,
    "reward_timeouts": 0,
}
STEP_2 = {
    **STEP_1,
    "step": 2,
    "policy_version": 2,
    "reward_mean": 0.4,
    "accuracy": 0.35,
    "tokens_generated": 400,
    "gen_tokens_per_s": 160.0,
    "learn_tokens_per_s": 800.0,
    "time_gen_s": 2.5,
    "time_learn_s": 0.5,
    "staleness_mean": 0.5,
    "reward_errors": 3,
    "reward_timeouts": 2,
}
JOB = "unit-run"


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """Every sample of the endpoint: (sample name, labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset({"job": JOB, **labels}.items()))]


@pytest.fixture
def exporter():
    exp = PrometheusExporter(JOB, port=0, addr="127.0.0.1")
    yield exp
    exp.close()


def test_port_zero_binds_a_free_port_and_serves(exporter):
    assert exporter.port > 0
    scrape(exporter.port)  # answers before any step was observed


def test_gauges_follow_the_latest_step(exporter):
    exporter.observe_step(STEP_1)
    exporter.observe_step(STEP_2)
    samples = scrape(exporter.port)
    assert sample(samples, "groupflow_step") == 2
    assert sample(samples, "groupflow_policy_version") == 2
    assert sample(samples, "groupflow_reward_mean") == pytest.approx(0.4)
    assert sample(samples, "groupflow_accuracy") == pytest.approx(0.35)
    assert sample(samples, "groupflow_response_length_mean") == pytest.approx(7.5)
    assert sample(samples, "groupflow_entropy_neg") == pytest.approx(0.7)
    assert sample(samples, "groupflow_spurious_frac") == pytest.approx(0.01)
    assert sample(samples, "groupflow_lowprob_grad_share") == pytest.approx(0.8)
    assert sample(samples, "groupflow_cancellation_residual") == pytest.approx(0.9)
    assert sample(samples, "groupflow_clip_frac_high") == pytest.approx(0.03)
    assert sample(samples, "groupflow_approx_kl") == pytest.approx(0.001)
    assert sample(samples, "groupflow_grad_norm") == pytest.approx(1.5)
    assert sample(samples, "groupflow_staleness_mean") == pytest.approx(0.5)
    assert sample(samples, "groupflow_tokens_per_second", stage="generation") == 160.0
    assert sample(samples, "groupflow_tokens_per_second", stage="learning") == 800.0


def test_stage_latency_histograms_count_every_step(exporter):
    exporter.observe_step(STEP_1)
    exporter.observe_step(STEP_2)
    samples = scrape(exporter.port)
    for stage in ("generation", "reward", "learning", "weight_sync"):
        assert sample(samples, "groupflow_stage_latency_seconds_count", stage=stage) == 2
    generation_sum = sample(samples, "groupflow_stage_latency_seconds_sum", stage="generation")
    assert generation_sum == pytest.approx(3.0 + 2.5)
    # Both generation times (3.0 s, 2.5 s) fall at or below the 5 s bucket, neither below 2.5 s.
    bucket = "groupflow_stage_latency_seconds_bucket"
    assert sample(samples, bucket, stage="generation", le="5.0") == 2
    assert sample(samples, bucket, stage="generation", le="2.5") == 1
    assert sample(samples, bucket, stage="generation", le="1.0") == 0


def test_counters_add_up_steps_and_running_totals(exporter):
    exporter.observe_step(STEP_1)
    first = scrape(exporter.port)
    exporter.observe_step(STEP_2)
    second = scrape(exporter.port)
    assert sample(first, "groupflow_tokens_generated_total") == 600
    assert sample(second, "groupflow_tokens_generated_total") == 1000
    # reward_errors/reward_timeouts arrive as totals so far: exported as the same totals.
    assert sample(first, "groupflow_reward_errors_total") == 1
    assert sample(second, "groupflow_reward_errors_total") == 3
    assert sample(first, "groupflow_reward_timeouts_total") == 0
    assert sample(second, "groupflow_reward_timeouts_total") == 2


def test_a_running_total_that_restarts_keeps_the_counter_rising(exporter):
    exporter.observe_step(STEP_2)  # 3 errors so far
    exporter.observe_step({"reward_errors": 1})  # the source restarted and has seen 1 since
    assert sample(scrape(exporter.port), "groupflow_reward_errors_total") == 4


def test_cluster_counts_and_queue_depths(exporter):
    exporter.set_cluster(engines=2, reward_workers=4, learner_ranks=2)
    exporter.set_queue_depth("reward", 7)
    exporter.set_queue_depth("generation", 3)
    exporter.set_cluster(engines=2, reward_workers=3, learner_ranks=2)  # a worker was lost
    samples = scrape(exporter.port)
    assert sample(samples, "groupflow_engines") == 2
    assert sample(samples, "groupflow_reward_workers") == 3
    assert sample(samples, "groupflow_learner_ranks") == 2
    assert sample(samples, "groupflow_queue_depth", queue="reward") == 7
    assert sample(samples, "groupflow_queue_depth", queue="generation") == 3


def test_prompts_left_out_by_source(exporter):
    exporter.set_prompts_left_out({"task math": 3, "task.eval_sets hard": 0})
    samples = scrape(exporter.port)
    assert sample(samples, "groupflow_prompts_left_out", source="task math") == 3
    assert sample(samples, "groupflow_prompts_left_out", source="task.eval_sets hard") == 0


def test_keys_missing_from_a_record_export_nothing(exporter):
    exporter.observe_step({"step": 1, "reward_mean": 0.5})
    names = {name for name, _ in scrape(exporter.port)}
    assert "groupflow_reward_mean" in names
    assert "groupflow_spurious_frac" not in names
    assert "groupflow_stage_latency_seconds_count" not in names


def test_every_sample_is_prefixed_and_labelled_with_the_job(exporter):
    exporter.observe_step(STEP_1)
    exporter.set_cluster(1, 1, 1)
    exporter.set_queue_depth("reward", 0)
    for name, labels in scrape(exporter.port):
        assert name.startswith("groupflow_")
        assert ("job", JOB) in labels


def test_exported_metric_list_matches_the_endpoint(exporter):
    exporter.observe_step({**STEP_1, "eval_accuracy": 0.5, "reward_std": 0.1})
    exporter.observe_step({**STEP_2, "logp_mismatch_mean": 1e-6})
    exporter.set_cluster(1, 2, 2)
    exporter.set_queue_depth("reward", 1)
    with urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics") as response:
        families = list(text_string_to_metric_families(response.read().decode()))
    # As PromQL spells them: a counter with _total, a histogram by its base name. The
    # *_created series are prometheus_client's creation timestamps, not metrics of their own.
    names = {
        f"{f.name}_total" if f.type == "counter" else f.name
        for f in families
        if not f.name.endswith("_created")
    }
    assert names == EXPORTED_METRICS


def test_exporters_have_separate_registries_and_close_frees_the_endpoint():
    first = PrometheusExporter("run-a", port=0, addr="127.0.0.1")
    second = PrometheusExporter("run-b", port=0, addr="127.0.0.1")
    try:
        first.observe_step({"step": 5})
        second.observe_step({"step": 9})
        assert scrape(first.port)[("groupflow_step", frozenset({("job", "run-a")}))] == 5
        assert scrape(second.port)[("groupflow_step", frozenset({("job", "run-b")}))] == 9
    finally:
        first.close()
        second.close()
    with pytest.raises(urllib.error.URLError):
        scrape(first.port)


def test_per_task_figures_are_one_labelled_series_each(exporter):
    exporter.observe_step({"step": 1, "task_reward_mean": {"math": 0.25, "code": 0.5}})
    exporter.observe_step({"step": 2, "task_accuracy": {"math": 0.1}})
    exporter.observe_step({"step": 3, "task_reward_mean": {"math": 0.75}})
    samples = scrape(exporter.port)
    assert sample(samples, "groupflow_task_reward_mean", task="math") == 0.75
    assert sample(samples, "groupflow_task_reward_mean", task="code") == 0.5
    assert sample(samples, "groupflow_task_accuracy", task="math") == pytest.approx(0.1)


def test_tool_series_count_per_tool_and_observe_each_call(exporter):
    agent = {"tool_calls": {"python": 3, "(malformed)": 1}, "tool_latency_s": [0.002, 0.3, 7.0]}
    exporter.observe_step({**STEP_1, **agent})
    exporter.observe_step({**STEP_2, **agent, "end_reasons": {"answer": 5, "turn_limit": 2}})
    samples = scrape(exporter.port)
    assert sample(samples, "groupflow_tool_calls_total", tool="python") == 6
    assert sample(samples, "groupflow_tool_calls_total", tool="(malformed)") == 2
    assert sample(samples, "groupflow_trajectory_end_reasons_total", reason="turn_limit") == 2
    bucket = "groupflow_tool_latency_seconds_bucket"
    assert sample(samples, "groupflow_tool_latency_seconds_count") == 6
    assert sample(samples, bucket, le="0.005") == 2
    assert sample(samples, bucket, le="5.0") == 4


def test_held_out_scores_outside_a_step_are_exported(exporter):
    """Before and after training (eval_every 0 too), the held-out scores reach the accuracy
    panel's series, per task of a mixture as well, and the warm start's stays beside them."""
    warm = {"eval_accuracy": 0.25, "eval_task_accuracy": {"sums": 0.5, "long": 0.0}}
    exporter.observe_held_out({"warm_start_accuracy": 0.25, **warm})
    samples = scrape(exporter.port)
    assert sample(samples, "groupflow_warm_start_accuracy") == 0.25
    assert sample(samples, "groupflow_eval_accuracy") == 0.25
    assert sample(samples, "groupflow_eval_task_accuracy", task="sums") == 0.5
    assert sample(samples, "groupflow_eval_task_accuracy", task="long") == 0.0
    assert ("groupflow_step", frozenset({("job", JOB)})) not in samples  # no step was taken
    exporter.observe_held_out({"eval_accuracy": 0.75, "eval_task_accuracy": {"long": 0.5}})
    samples = scrape(exporter.port)
    assert sample(samples, "groupflow_eval_accuracy") == 0.75
    assert sample(samples, "groupflow_eval_task_accuracy", task="long") == 0.5
    assert sample(samples, "groupflow_warm_start_accuracy") == 0.25


def test_a_finished_job_waits_for_its_scraper_to_read_the_final_scores(exporter):
    """Only when something scrapes the endpoint, and for twice its interval at most."""
    started = time.monotonic()
    assert exporter.await_scrape() is False  # nothing scrapes it: no wait at all
    assert time.monotonic() - started < 0.1
    for _ in range(2):  # scraped during the run, every 0.2 s
        scrape(exporter.port)
        time.sleep(0.2)
    exporter.observe_held_out({"eval_accuracy": 0.75})
    read = []
    later = threading.Timer(0.1, lambda: read.append(scrape(exporter.port)))
    later.start()
    assert exporter.await_scrape() is True
    later.join()
    assert sample(read[0], "groupflow_eval_accuracy") == 0.75
    # a scraper that has gone: the job waits about twice the interval it saw, then ends
    exporter.observe_held_out({"eval_accuracy": 0.5})
    started = time.monotonic()
    assert exporter.await_scrape() is False
    assert 0.1 < time.monotonic() - started < 2.0
