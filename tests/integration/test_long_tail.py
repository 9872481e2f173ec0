"""The long-tail workload on the real stack (issue 22): in each group one response eight times
as long as the rest, at staleness 0, 1 and 2, with partial rollouts (the default off-policy
setting): the engines load new weights while the long responses run.

The workload is bench/step_time.py's `long_tail`, installed in each engine as the job starts
it (the bench installs it in every Ray worker instead, through a job-level setup hook, which
would need a driver process of its own and new worker processes for every actor).

Each run also trains an algorithm preset with its riders (tests/integration/test_presets.py
says which and checks them): a run of their own each would cost a job start for what the
long tail's checks do not depend on. So does the metrics test: a real Prometheus server scrapes
the staleness-1 run (tests/integration/scraped_run.py)."""

from __future__ import annotations

import importlib.util
import json
from functools import partial
from pathlib import Path

import pytest
import ray

import groupflow.run.job_actors
from groupflow.run.driver import run
from groupflow.run.job_config import small_model_config
from tests.integration.scraped_run import ScrapedRun
from tests.integration.test_presets import (
    ON_LONG_TAIL,
    ON_THE_MIXTURE_OF_EXPERTS,
    check_preset_run,
    preset_settings,
)

pytestmark = pytest.mark.integration

FACTOR = 8
MAX_TOKENS = 6  # the short responses; the long one has FACTOR times as many
GROUP_SIZE = 4
PROMPTS_PER_STEP = 8
STEPS = 3
SCRAPED = 1  # the staleness bound of the run that Prometheus scrapes


def _long_tail():
    path = Path(__file__).resolve().parents[2] / "bench" / "step_time.py"
    spec = importlib.util.spec_from_file_location("step_time_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench.long_tail(FACTOR)


@pytest.fixture
def long_tail_engines(monkeypatch):
    install = _long_tail()
    start = groupflow.run.job_actors.start_generator_pool
    make_transport = groupflow.run.job_actors.make_transport
    installs = []

    def start_long_tailed(*args, **kwargs):
        pool = start(*args, **kwargs)
        # queued behind each engine's start: the learner ranks start meanwhile
        installs.extend(e.__ray_call__.remote(lambda _: install()) for e in pool.engines)
        return pool

    def installed_first(*args, **kwargs):  # the job's last start, before any generation
        ray.get(installs)
        installs.clear()
        return make_transport(*args, **kwargs)

    monkeypatch.setattr(groupflow.run.job_actors, "start_generator_pool", start_long_tailed)
    monkeypatch.setattr(groupflow.run.job_actors, "make_transport", installed_first)


def test_long_tail_groups_train_every_step_once_within_the_staleness_bound(
    ray_cluster, quickstart_model, chat_model, long_tail_engines, tmp_path, request
):
    staleness = [0, 1, 2]
    for k in staleness:
        model = []
        if ON_LONG_TAIL[k] in ON_THE_MIXTURE_OF_EXPERTS:
            model = [f"model.path={request.getfixturevalue('small_moe_model')}"]
        overrides = [
            f"trainer.output_dir={tmp_path}",
            f"trainer.run_name=k{k}",
            f"trainer.steps={STEPS}",
            f"trainer.max_staleness={k}",
            f"rollout.group_size={GROUP_SIZE}",
            f"rollout.prompts_per_step={PROMPTS_PER_STEP}",
            f"rollout.sampling.max_tokens={MAX_TOKENS}",
            "task.eval_size=8",
            "metrics.progress=false",
            *preset_settings(ON_LONG_TAIL[k]),  # one learner rank, two mini-batches a step
            *model,
        ]
        if k == SCRAPED:
            scraped = ScrapedRun(tmp_path, chat_model)
            try:
                scraped.run(partial(run, small_model_config({}, overrides + scraped.settings)))
                scraped.check(tmp_path / f"k{k}")
            finally:
                scraped.stop()
        else:
            run(small_model_config({}, overrides))
    # every group: G - 1 short responses and one FACTOR times as long, each exactly its length
    group_tokens = (GROUP_SIZE - 1 + FACTOR) * MAX_TOKENS
    for k in staleness:
        lines = (tmp_path / f"k{k}" / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        assert [r["step"] for r in records] == list(range(1, STEPS + 1)), k
        assert all(r["num_groups"] == PROMPTS_PER_STEP for r in records), k
        assert all(r["tokens_generated"] == PROMPTS_PER_STEP * group_tokens for r in records), k
        assert max(r["staleness_max"] for r in records) <= k
        assert all(r["groups_dropped_stale"] == 0 for r in records), k
        # every sync but the last one's checked by the end (a record counts the loads checked
        # since the previous one: the sync after a step is checked in a later step)
        assert sum(r["weight_sync_verified"] for r in records) >= STEPS - 1, k
        check_preset_run(ON_LONG_TAIL[k], records, tmp_path / f"k{k}")
