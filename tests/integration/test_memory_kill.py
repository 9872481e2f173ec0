"""An actor that Ray's own memory monitor kills is reported in one line (actors/memory_kill.py,
docs/learner_memory.md): a real reward worker on a node of the shared cluster whose raylet
kills any running task above 0.1% of the machine's memory, scored through the job's futures."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
import ray

from groupflow.actors.futures import RayFutures
from groupflow.actors.memory_kill import killed_for_memory
from groupflow.actors.reward import RewardWorker
from groupflow.core.peers import PeerDied
from groupflow.core.records import Prompt
from tests.integration.ray_nodes import RayNode

pytestmark = pytest.mark.integration
PLUGIN = Path(__file__).parent / "plugins" / "rewards.py"


def test_a_reward_worker_killed_by_rays_memory_monitor_is_one_line(ray_cluster):
    gcs = ray.get_runtime_context().gcs_address
    # The monitor is the raylet's: set on this node only, it kills what runs here alone.
    env = {
        **os.environ,
        "RAY_memory_usage_threshold": "0.001",
        "RAY_memory_monitor_refresh_ms": "100",
    }
    node = RayNode([f"--address={gcs}", "--num-cpus=1", '--resources={"gf_oom": 1}'], env, "oom")
    try:
        worker = (
            ray.remote(RewardWorker)
            .options(num_cpus=0, resources={"gf_oom": 1}, max_restarts=0)
            .remote("arithmetic", {}, f"{PLUGIN}:sleeps_past_timeout", 30.0)
        )
        # the plugin sleeps 2 s on each response to this prompt (odd sum of its characters)
        prompt = Prompt("1+2=", "1+2=", 3)
        ref = worker.score.remote([(prompt, "3")] * 8, time.time() + 60)
        with pytest.raises(PeerDied) as died:
            RayFutures().get([ref])
    finally:
        node.stop()
    # Ray's own paragraph (its numbers from the raylet), read into the job's one line
    assert re.fullmatch(
        r"a reward worker \(RewardWorker\) was killed by Ray's memory monitor, holding "
        r"[\d.]+ GB resident, node [\d.]+ at [\d.]+ GB of [\d.]+ GB; lower reward\.num_workers",
        str(died.value),
    ), died.value
    assert killed_for_memory(died.value.__cause__)
