"""The reward pool on the shared local Ray cluster: lost workers. (A plugin that hangs in a
training job is tests/integration/test_agent.py's tool job's rider.)"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import ray

from groupflow.actors.reward import start_reward_pool
from groupflow.core.records import Response, SampledGroup
from groupflow.reward_workers.tasks import make_task
from groupflow.run.job_config import small_model_config

pytestmark = pytest.mark.integration
PLUGINS = Path(__file__).parent / "plugins" / "rewards.py"


def _groups(n: int, group_size: int = 4) -> list[SampledGroup]:
    task = make_task("arithmetic")
    prompts = [p for p, _ in zip(task.train_prompts(7), range(n), strict=False)]
    # half of each group answers correctly, so every sample's reward is known in advance
    return [
        SampledGroup(
            p,
            [1, 2],
            [Response([1], str(p.answer) if k % 2 == 0 else "x", [0.0]) for k in range(group_size)],
            0,
        )
        for p in prompts
    ]


def test_a_worker_killed_mid_batch_loses_no_sample(ray_cluster):
    cfg = small_model_config({}, ["reward.num_workers=2", f"reward.verifier={PLUGINS}:slow_exact"])
    pool = start_reward_pool(cfg)
    # asked first: an actor answers calls in order
    victim = ray.get(pool.workers[0].__ray_call__.remote(lambda _: os.getpid()))
    killed = pool.workers[0]
    groups = _groups(16)
    # 4 batches of 16 responses, about 0.8 s each, of two chunks taking turns
    for i in range(0, 16, 4):
        pool.submit(groups[i : i + 4], chunk_id=i // 4 % 2)
    time.sleep(0.5)
    os.kill(victim, signal.SIGKILL)
    scored = pool.wait_all()
    first, second = scored[0], scored[1]
    # the other worker scored the dead one's batch; its replacement fills the slot when up
    while pool.in_flight():
        pool.take(ray.wait(pool.in_flight(), timeout=120)[0])
    assert pool.workers[0] is not killed, "the dead worker was replaced"
    assert pool.state().live == 2
    for scored, chunk in ((first, 0), (second, 1)):
        expected = [g for i in range(0, 16, 4) if i // 4 % 2 == chunk for g in groups[i : i + 4]]
        assert sorted(s.group.prompt.uid for s in scored) == sorted(g.prompt.uid for g in expected)
        for s in scored:
            assert s.rewards == [1.0, 0.0, 1.0, 0.0], s.verdicts
    assert pool.errors == pool.timeouts == 0 and pool.pending_groups() == 0
    pool.shutdown()


def test_batches_wait_for_a_replacement_when_every_worker_was_lost(ray_cluster):
    """The pool's one worker dies in its first of two batches: both (retried) and one
    submitted while no worker is left wait for the replacement and are scored there."""
    cfg = small_model_config({}, ["reward.num_workers=1", f"reward.verifier={PLUGINS}:slow_exact"])
    pool = start_reward_pool(cfg)
    victim = ray.get(pool.workers[0].__ray_call__.remote(lambda _: os.getpid()))
    groups = _groups(12)
    pool.submit(groups[:4], chunk_id=0)  # about 0.8 s each: the kill lands in the first
    pool.submit(groups[4:8], chunk_id=0)
    time.sleep(0.2)
    os.kill(victim, signal.SIGKILL)
    ready, _ = ray.wait(pool.in_flight(), num_returns=2, timeout=60)
    # both lost their worker: nothing scored, to be retried, on no worker yet
    assert [groups for _, groups in pool.take(ready)] == [[], []]
    pool.submit(groups[8:], chunk_id=1)
    assert pool.pending_groups() == 12 and pool.state().live == 0
    scored = pool.wait_all()
    for chunk, expected in ((0, groups[:8]), (1, groups[8:])):
        assert sorted(s.group.prompt.uid for s in scored[chunk]) == sorted(
            g.prompt.uid for g in expected
        )
        assert all(s.rewards == [1.0, 0.0, 1.0, 0.0] for s in scored[chunk])
    assert pool.state().live == 1 and pool.errors == pool.timeouts == 0
    pool.shutdown()
