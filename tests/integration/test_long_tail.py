"""The long-tail workload on the real stack (issue 22): in each group one response eight times
as long as the rest, at staleness 0, 1 and 2, with partial rollouts (the default off-policy
setting): the engines load new weights while the long responses run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from tests.integration.long_tail_driver import (
    FACTOR,
    GROUP_SIZE,
    MAX_TOKENS,
    PROMPTS_PER_STEP,
    STEPS,
)

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def test_long_tail_groups_train_every_step_once_within_the_staleness_bound(
    ray_cluster, quickstart_model, tmp_path
):
    address = ray.get_runtime_context().gcs_address
    staleness = [0, 1, 2]
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integration.long_tail_driver", address, str(tmp_path)]
        + [str(k) for k in staleness],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
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
