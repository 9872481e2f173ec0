"""An actor's threads come from its own resources (groupflow/core/threads.py), not from the
node's core count."""

from __future__ import annotations

import pytest

from groupflow.core.threads import actor_threads, thread_env
from groupflow.run.job_config import build_config


@pytest.mark.parametrize(
    ("num_cpus", "cpu_cores", "torch_threads", "threads"),
    [
        (0.25, [], None, 1),  # a fraction of a CPU still runs a thread
        (0.5, [], None, 1),
        (1.0, [], None, 1),
        (2.7, [], None, 2),  # whole CPUs only: a third thread would oversubscribe
        (8.0, [], None, 8),  # a GPU node's rank or engine with CPUs of its own
        (0.5, [2, 3, 5], None, 3),  # pinned: the cores are its own
        (8.0, [0], None, 1),
        (0.5, [0, 1], 4, 4),  # set explicitly: as set
    ],
)
def test_an_actors_threads_are_its_whole_cpus_its_cores_or_as_set(
    num_cpus, cpu_cores, torch_threads, threads
):
    assert actor_threads(num_cpus, cpu_cores, torch_threads) == threads


def test_every_pool_of_every_actor_kind_gets_its_own_count():
    cfg = build_config(
        {},
        [
            "rollout.resources.num_cpus=3",
            "reward.resources.num_cpus=2",
            "learner.resources.cpu_cores=[0,1]",
        ],
    )
    assert (cfg.rollout.resources.threads, cfg.reward.resources.threads) == (3, 2)
    assert cfg.learner.resources.threads == 2
    default = build_config({}, [])  # the CPU defaults: a thread each, as before
    assert {getattr(default, s).resources.threads for s in ("rollout", "reward", "learner")} == {1}


def test_the_environment_holds_every_thread_pool_to_the_count():
    env = thread_env(3)
    for pool in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS"):
        assert env[pool] == "3"
    assert thread_env(4, intra_op=1)["OMP_NUM_THREADS"] == "1"
    assert thread_env(4, intra_op=1)["RAYON_NUM_THREADS"] == "4"
