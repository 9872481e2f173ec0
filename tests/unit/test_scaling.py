"""Scaling a running job (groupflow/loop/scaling.py and its control protocol,
groupflow/core/scaling_protocol.py): request checks, the autoscale policy, the Scaler, and the real
generator pool growing and shrinking inside the job loop over the fake engines of
tests/unit/job_loop_fakes.py (no Ray)."""

from __future__ import annotations

import pytest

from groupflow.actors.control import limits_for
from groupflow.core.scaling_protocol import (
    LiveStatus,
    PoolState,
    ScaleError,
    ScaleLimits,
    ScaleRequest,
    check_request,
    ray_demand,
)
from groupflow.loop.scaling import AutoscalePolicy, Scaler, policy_for
from groupflow.run.job_config import build_config
from tests.unit.job_loop_fakes import (
    GROUP_SIZE,
    PROMPTS_PER_STEP,
    FakeEngine,
    Remote,
    run_job,
)

CPU_NODE = {"CPU": 8.0, "memory": 1e10}
LIMITS = ScaleLimits(True, {"CPU": 0.5}, {"CPU": 0.25})


# ----- requests ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "request_, message",
    [
        (ScaleRequest(), "nothing to scale: give --engines and/or --reward-workers"),
        (ScaleRequest(engines=0), "--engines: a job needs at least one engine (got 0)"),
        (ScaleRequest(engines=-1), "--engines: a count cannot be negative (got -1)"),
        (
            ScaleRequest(reward_workers=0),
            "--reward-workers: a job needs at least one reward worker (got 0)",
        ),
        (
            ScaleRequest(engines=2, reward_workers=-3),
            "--reward-workers: a count cannot be negative (got -3)",
        ),
    ],
)
def test_bad_counts_are_refused_in_one_line(request_, message):
    with pytest.raises(ScaleError) as err:
        check_request(request_, LIMITS, [CPU_NODE])
    assert str(err.value) == message


def test_a_resource_no_node_has_is_refused_but_a_full_cluster_is_not():
    gpu = ScaleLimits(True, ray_demand(1, 1, {}), {"CPU": 0.25})
    with pytest.raises(ScaleError, match="^--engines: one engine needs GPU=1 and no node"):
        check_request(ScaleRequest(engines=2), gpu, [CPU_NODE, {"CPU": 2.0}])
    # reward workers need no GPU: they can still scale
    check_request(ScaleRequest(reward_workers=4), gpu, [CPU_NODE])
    custom = ScaleLimits(True, {"CPU": 0.5}, ray_demand(0.25, 0, {"verifier": 1}))
    with pytest.raises(ScaleError, match="one reward worker needs verifier=1"):
        check_request(ScaleRequest(reward_workers=3), custom, [CPU_NODE])
    # 100 engines do not fit now, but each fits on a node: they wait for room
    check_request(ScaleRequest(engines=100), LIMITS, [{"CPU": 0.5}])


def test_collective_transport_refuses_engines_but_not_reward_workers():
    cfg = build_config({}, ["rollout.weight_transport=collective"])
    limits = limits_for(cfg)
    with pytest.raises(ScaleError, match="weight_transport=collective"):
        check_request(ScaleRequest(engines=2), limits, [CPU_NODE])
    check_request(ScaleRequest(reward_workers=3), limits, [CPU_NODE])


def test_with_autoscale_a_request_stays_within_its_bounds():
    cfg = build_config({}, ["rollout.autoscale={min_engines: 1, max_engines: 3}"])
    with pytest.raises(ScaleError, match=r"outside rollout.autoscale's bounds \[1, 3\]"):
        check_request(ScaleRequest(engines=4), limits_for(cfg), [CPU_NODE])
    assert limits_for(cfg).engine_demand == {"CPU": 0.5}
    assert policy_for(build_config({})) is None


# ----- the autoscale policy -------------------------------------------------------------------
def record(wait: float, gen: float, step: float = 10.0) -> dict:
    return {"time_step_s": step, "time_wait_rollout_s": wait, "time_gen_s": gen}


GEN_BOUND = record(wait=6.0, gen=8.0)  # the learner waited 60% of the step
IDLE = record(wait=0.0, gen=2.0)  # generation hides behind learning with room to spare
BETWEEN = record(wait=1.0, gen=7.0)  # neither: the hysteresis band


def test_autoscale_adds_an_engine_after_patience_generation_bound_steps():
    policy = AutoscalePolicy(1, 3, patience=2)
    assert policy.decide(GEN_BOUND, 1, settled=True) is None
    assert policy.decide(GEN_BOUND, 1, settled=True) == 2


def test_autoscale_waits_while_a_change_is_under_way_and_a_cooldown_after():
    policy = AutoscalePolicy(1, 3, patience=1, cooldown_steps=1)
    assert policy.decide(GEN_BOUND, 2, settled=False) is None  # an engine still starting
    assert policy.decide(GEN_BOUND, 2, settled=True) is None  # cooldown
    assert policy.decide(GEN_BOUND, 2, settled=True) == 3


def test_autoscale_stays_within_its_bounds():
    policy = AutoscalePolicy(1, 2, patience=1)
    assert [policy.decide(GEN_BOUND, 2, settled=True) for _ in range(5)] == [None] * 5
    policy = AutoscalePolicy(2, 4, patience=1)
    assert [policy.decide(IDLE, 2, settled=True) for _ in range(5)] == [None] * 5


def test_autoscale_removes_an_idle_engine_and_does_not_flap():
    policy = AutoscalePolicy(1, 4, patience=2)
    assert policy.decide(IDLE, 3, settled=True) is None
    assert policy.decide(IDLE, 3, settled=True) == 2
    # the band between the thresholds changes nothing, however long it lasts
    policy = AutoscalePolicy(1, 4, patience=2)
    assert [policy.decide(BETWEEN, 2, settled=True) for _ in range(10)] == [None] * 10
    # signals that alternate never hold `patience` steps in a row
    flapping = [GEN_BOUND, IDLE] * 5
    assert [policy.decide(r, 2, settled=True) for r in flapping] == [None] * 10


def test_a_removal_that_would_make_the_learner_wait_is_not_made():
    # 2 engines generate in 4 s of a 10 s step; 1 engine would take 8 s, above 60% of it
    policy = AutoscalePolicy(1, 4, patience=1)
    assert policy.decide(record(wait=0.0, gen=4.0), 2, settled=True) is None
    assert policy.decide(record(wait=0.0, gen=2.5), 2, settled=True) == 1


# ----- the Scaler over fake pools ---------------------------------------------------------------
class FakePool:
    """Actors join one settle after they are asked for; retired ones leave at the next."""

    def __init__(self, live: int):
        self.live, self.target, self.coming, self.going = live, live, 0, 0

    def scale_to(self, target):
        self.target = target
        self.coming, self.going = max(0, target - self.live), max(0, self.live - target)

    def settle(self):
        joined, left = self.coming, self.going
        self.live += joined - left
        self.coming = self.going = 0
        return PoolState(self.live, self.target, joined=joined, left=left)

    def state(self):
        return PoolState(self.live, self.target, starting=self.coming, retiring=self.going)


class ListInbox:
    def __init__(self, requests: dict[int, ScaleRequest]):
        self.requests, self.polls, self.reports = requests, 0, []

    def poll(self):
        self.polls += 1
        return self.requests.get(self.polls)

    def report(self, status: LiveStatus):
        self.reports.append(status)

    def close(self):
        pass


def test_the_scaler_applies_requests_and_records_what_each_step_ran_with():
    engines, rewards = FakePool(1), FakePool(2)
    inbox = ListInbox({1: ScaleRequest(engines=2, reward_workers=3), 3: ScaleRequest(engines=1)})
    scaler = Scaler("unit", engines, rewards, 2, inbox=inbox, log=lambda line: None)
    out = [scaler.between_steps({"step": s}) for s in range(1, 6)]
    assert [o["num_engines"] for o in out] == [1, 1, 2, 2, 1]
    assert [o["num_reward_workers"] for o in out] == [2, 2, 3, 3, 3]
    assert [o["scale_events"] for o in out] == [2, 2, 1, 1, 0]
    assert inbox.reports[-1].lines() == [
        "run unit: step 5, autoscale off",
        "engines: 1 live, target 1",
        "reward workers: 3 live, target 3",
        "learner ranks: 2",
    ]
    assert LiveStatus.from_dict(inbox.reports[0].as_dict()) == inbox.reports[0]


def test_an_explicit_engine_count_turns_autoscaling_off():
    engines = FakePool(1)
    scaler = Scaler(
        "unit",
        engines,
        FakePool(1),
        1,
        inbox=ListInbox({3: ScaleRequest(engines=1)}),
        policy=AutoscalePolicy(1, 3, patience=2, cooldown_steps=0),
        log=lambda line: None,
    )
    counts = []
    for step in range(1, 9):
        scaler.between_steps({"step": step, **GEN_BOUND})
        counts.append(engines.target)
    # autoscale: 2 after two generation-bound steps; the request sets 1 at step 3; no more
    assert counts == [1, 2, 1, 1, 1, 1, 1, 1]
    assert scaler.autoscale == "off (set by groupflow scale)"


# ----- the real generator pool in the job loop --------------------------------------------------
class ScalableFakeEngine(FakeEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.terminated = False
        self.first_chunk_version: int | None = None
        self.__ray_terminate__ = Remote(self._terminate)
        sample = self.sample.remote

        def first(prompts, group_size, sampling, min_version=0):
            if self.first_chunk_version is None:
                self.first_chunk_version = self.version
            return sample(prompts, group_size, sampling, min_version)

        self.sample = Remote(first)

    def _terminate(self):
        self.terminated = True


class InstantStarting:
    """Engines come up at the first settle after they are asked for (Ray's StartingActors
    stand-in)."""

    def __init__(self):
        self.actors = []

    def __len__(self):
        return len(self.actors)

    def add(self, actor):
        self.actors.append(actor)

    def take_ready(self):
        ready, self.actors = self.actors, []
        return ready, 0

    def cancel(self, count):
        n = min(count, len(self.actors))
        del self.actors[len(self.actors) - n :]
        return n

    def placed(self):
        return len(self.actors)

    def shutdown(self):
        self.actors = []


@pytest.mark.parametrize("staleness", [0, 1])
def test_engines_added_and_removed_while_the_job_trains(staleness):
    """One engine, two from step 4, one again from step 7: every prompt trained exactly once
    and in order, the new engine loaded the current weights before its first chunk, and no
    restart is counted; each record tells how many engines served it."""
    steps = 8
    inbox = ListInbox({2: ScaleRequest(engines=2), 5: ScaleRequest(engines=1)})
    run = run_job(
        steps,
        staleness,
        engines=1,
        engine_type=ScalableFakeEngine,
        starting=InstantStarting(),
        scaler=lambda pool, rewards: Scaler(
            "unit", pool, rewards, 2, inbox=inbox, log=lambda line: None
        ),
    )
    pool, engines = run.job.generators, run.engines

    # asked for after step 2, up for step 4; retired after step 5, gone for step 7
    assert [r["num_engines"] for r in run.records] == [1, 1, 1, 2, 2, 2, 1, 1]
    trained = sorted(int(s.input_ids[0]) for seqs in run.learner.steps for s in seqs)
    # each prompt's GROUP_SIZE sequences, every prompt of the stream once
    assert trained == sorted(list(range(steps * PROMPTS_PER_STEP)) * GROUP_SIZE)
    (new,) = run.started
    assert new.prompts_sampled > 0  # it took work
    assert new.first_chunk_version is not None and new.first_chunk_version == 3
    assert new.terminated and pool.figures().engines == 1 and pool.engines == [engines[0]]
    assert pool.restarts.engines == 0 and all(r["engine_restarts"] == 0 for r in run.records)
    assert all(r["staleness_max"] <= staleness for r in run.records)
    # what `groupflow status` was told last: the last step trained, not the one before
    assert inbox.reports[-1].step == steps


# ----- the command line (no cluster) ------------------------------------------------------------
def parse(argv: list[str]):
    import argparse

    from groupflow.run.jobs import add_job_commands

    parser = argparse.ArgumentParser(prog="groupflow")
    add_job_commands(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_scale_arguments():
    args = parse(["scale", "myrun", "--engines", "3", "--reward-workers", "4", "--no-wait"])
    assert (args.run, args.engines, args.reward_workers, args.no_wait) == ("myrun", 3, 4, True)
    assert args.runs == "runs" and args.address is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--engines", "0"], "--engines: a job needs at least one engine (got 0)"),
        (["--reward-workers", "-1"], "--reward-workers: a count cannot be negative (got -1)"),
        ([], "nothing to scale: give --engines and/or --reward-workers"),
    ],
)
def test_bad_counts_fail_before_any_cluster_is_contacted(monkeypatch, capsys, argv, message):
    import ray.job_submission

    from groupflow.run.cli import main

    def refuse(*args, **kwargs):
        raise AssertionError("a cluster was contacted")

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", refuse)
    monkeypatch.setattr(ray, "init", refuse)
    assert main(["scale", "myrun", *argv]) == 2
    assert capsys.readouterr().err == f"groupflow: error: {message}\n"


def test_a_run_whose_driver_has_ended_is_not_running(tmp_path, capsys):
    import json
    import subprocess
    import sys

    from groupflow.run.cli import main
    from groupflow.run.live import write_cluster_file

    (tmp_path / "r").mkdir()
    path = write_cluster_file(tmp_path / "r", "r", "127.0.0.1:1")
    ended = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    record = json.loads(path.read_text()) | {"pid": int(ended.stdout)}
    path.write_text(json.dumps(record))
    code = main(["scale", "r", "--runs", str(tmp_path), "--engines", "2"])
    assert code == 1
    assert capsys.readouterr().err == (
        f"groupflow: error: run r is not running (its driver, pid {record['pid']}, has ended)\n"
    )


# ----- Prometheus -------------------------------------------------------------------------------
class PendingPool(FakePool):
    """Its new actors stay pending: the cluster has no room."""

    def settle(self):
        return PoolState(self.live, self.target, pending=max(0, self.target - self.live))

    def state(self):
        return self.settle()


def test_live_counts_pending_actors_and_scale_events_are_exported():
    from groupflow.observe.prometheus import PrometheusExporter
    from tests.unit.test_prometheus_exporter import scrape

    exporter = PrometheusExporter("unit", port=0, addr="127.0.0.1")
    try:
        scaler = Scaler(
            "unit",
            PendingPool(1),
            FakePool(2),
            2,
            inbox=ListInbox({1: ScaleRequest(engines=3, reward_workers=3)}),
            gauges=exporter,
            log=lambda line: None,
        )
        for step in (1, 2):
            exporter.observe_step({"step": step, **scaler.between_steps({"step": step})})
        samples = scrape(exporter.port)
    finally:
        exporter.close()

    def value(name, **labels):
        return samples[(name, frozenset({"job": "unit", **labels}.items()))]

    assert value("groupflow_engines") == 1
    assert value("groupflow_reward_workers") == 3
    assert value("groupflow_learner_ranks") == 2
    assert value("groupflow_pending_actors", pool="engines") == 2
    assert value("groupflow_pending_actors", pool="reward_workers") == 0
    # step 1: two targets changed; step 2: the reward worker joined
    assert value("groupflow_scale_events_total") == 3
