"""Placement you can see: a pool's resources merge with its defaults (groupflow/config/base.py),
and every pool is placed within the startup deadline or the job fails in one line naming it
(groupflow/core/placement.py), on a virtual clock."""

from __future__ import annotations

import random

import pytest

from groupflow.config import Config
from groupflow.core.placement import (
    NOTE_AFTER_S,
    Placement,
    PlacementError,
    PoolAsk,
    describe_cluster,
)
from groupflow.run.job_config import build_config

POOLS = {"rollout": 0.5, "reward": 0.25, "learner": 0.5}  # each pool's default num_cpus


@pytest.mark.parametrize("section", sorted(POOLS))
def test_a_custom_resource_alone_keeps_the_pools_defaults(section):
    cfg = build_config({section: {"resources": {"custom": {"groupflow_pool": 1}}}})
    res = getattr(cfg, section).resources
    assert res.num_cpus == POOLS[section]  # not Resources' 1 CPU
    assert res.custom == {"groupflow_pool": 1.0}
    default = getattr(Config(), section).resources
    assert res.model_dump(exclude={"custom"}) == default.model_dump(exclude={"custom"})


def test_every_key_given_wins_and_every_key_left_out_keeps_the_pools_default():
    rng = random.Random()
    for _ in range(50):
        section = rng.choice(sorted(POOLS))
        given = {
            "num_cpus": round(rng.uniform(0, 4), 3),
            "num_gpus": float(rng.randint(0, 2)),
            "torch_threads": rng.randint(1, 8),
            "custom": {f"r{rng.randint(0, 9)}": float(rng.randint(1, 3))},
        }
        given = {k: v for k, v in given.items() if rng.random() < 0.5}
        overrides = [f"{section}.resources.{k}={v}" for k, v in given.items() if k != "custom"]
        raw = {section: {"resources": {"custom": given["custom"]}}} if "custom" in given else {}
        res = getattr(build_config(raw, overrides), section).resources.model_dump()
        default = getattr(Config(), section).resources.model_dump()
        assert res == default | given


def ask(pool="reward workers", count=2, **demand) -> PoolAsk:
    return PoolAsk(pool, "reward.resources", demand or {"CPU": 0.25, "nobody": 1.0}, count)


NODES = [{"CPU": 8.0, "memory": 1e9}, {"CPU": 4.0, "GPU": 1.0, "groupflow_rollout": 1.0}]
FREE = {"CPU": 1.5, "GPU": 1.0, "groupflow_rollout": 0.0}


class VirtualClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.now += seconds


def placement(pools, timeout_s, clock, notes=None):
    return Placement(
        pools,
        lambda: (NODES, FREE),
        timeout_s,
        clock=clock,
        sleep=clock.sleep,
        note=(notes if notes is not None else []).append,
    )


def placed_from(clock: VirtualClock, times: list[float]):
    """An actor per entry, placed once the clock reaches its time."""
    return lambda: sum(clock.now >= t for t in times)


def test_the_wait_ends_as_soon_as_every_pool_is_placed():
    rng = random.Random()
    for _ in range(20):
        clock, timeout = VirtualClock(), rng.uniform(30, 300)
        times = [[rng.uniform(0, timeout * 0.9) for _ in range(rng.randint(1, 4))] for _ in "abc"]
        pools = [(ask(f"pool {i}", len(t)), placed_from(clock, t)) for i, t in enumerate(times)]
        placement(pools, timeout, clock).wait()
        last = max(max(t) for t in times)
        assert last <= clock.now < last + 0.5


def test_a_pool_never_placed_fails_at_the_deadline_naming_pool_ask_and_cluster():
    clock, notes = VirtualClock(), []
    pools = [
        (ask("engines", 1, CPU=0.5), lambda: 1),
        (ask("reward workers", 2), placed_from(clock, [3.0, 1e9])),
    ]
    with pytest.raises(PlacementError) as err:
        placement(pools, 42.0, clock, notes).wait()
    assert 42.0 <= clock.now < 42.5
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("reward workers: 1 of 2 not placed")
    assert "cluster.placement_timeout_s=42" in line
    assert "{CPU: 0.25, nobody: 1} (reward.resources)" in line
    assert "CPU 1.5 free of 12 (at most 8 on one node), GPU 1 free of 1" in line
    assert line.endswith("no nobody")
    # Said once while it waited, after NOTE_AFTER_S, naming only the pool that waits.
    assert len(notes) == 1 and notes[0].startswith("waiting for 1 of 2 reward workers")


def test_a_short_wait_is_not_noted():
    clock, notes = VirtualClock(), []
    pools = [(ask(), placed_from(clock, [0.0, NOTE_AFTER_S / 2]))]
    placement(pools, 300.0, clock, notes).wait()
    assert notes == []


def test_the_cluster_is_described_per_resource_the_pool_asks_for():
    text = describe_cluster(NODES, FREE, {"CPU": 1.0, "groupflow_rollout": 1.0})
    assert text == (
        "2 live nodes: CPU 1.5 free of 12 (at most 8 on one node), GPU 1 free of 1 (at most "
        "1 on one node), groupflow_rollout 0 free of 1 (at most 1 on one node)"
    )
    assert describe_cluster([], {}, {"CPU": 1.0}) == "0 live nodes: no CPU, no GPU"
