"""End to end through the CLI entry point, on the shared local Ray cluster."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from groupflow.catalogue import BY_KEY
from groupflow.cli import main

pytestmark = pytest.mark.integration

STEP_KEYS = {
    "step",
    "policy_version",
    "reward_mean",
    "reward_std",
    "response_len_mean",
    "entropy_mean",
    "clip_frac",
    "grad_norm",
    "tokens_generated",
    "time_gen_s",
    "time_reward_s",
    "time_learn_s",
    "time_sync_s",
    "time_step_s",
    "staleness_mean",
}


def test_three_steps_with_overlap_write_the_run_directory(ray_cluster, quickstart_model, tmp_path):
    code = main(
        [
            "train",
            "--set",
            f"trainer.output_dir={tmp_path}",
            "--set",
            "trainer.run_name=e2e",
            "--set",
            "trainer.steps=3",
            "--set",
            "trainer.max_staleness=1",
            "--set",
            "task.eval_size=32",
            "--set",
            "learner.optimizer.lr=1e-3",
        ]
    )
    assert code == 0
    run = tmp_path / "e2e"
    assert (run / "config.resolved.yaml").is_file()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert STEP_KEYS <= r.keys(), STEP_KEYS - r.keys()
        # every key the job writes is documented in the metric catalogue
        assert r.keys() <= BY_KEY.keys(), r.keys() - BY_KEY.keys()
    # generation of step k+1 ran on version k-1 weights while step k trained: exactly one behind
    assert [r["staleness_max"] for r in records] == [0, 1, 1]
    summary = json.loads((run / "summary.json").read_text())
    assert {"warm_start_accuracy", "final_accuracy"} <= summary.keys()

    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(run / "model").state_dict()
    initial = AutoModelForCausalLM.from_pretrained(quickstart_model).state_dict()
    assert trained.keys() == initial.keys()
    assert any(not torch.equal(trained[k], initial[k]) for k in initial)


@pytest.mark.parametrize(
    "args, culprit",
    [
        (["--set", "rollout.group_sise=4"], "rollout.group_sise"),
        (["--set", "model.path=/nonexistent/model"], "model.path"),
        (["/nonexistent/job.yaml"], "/nonexistent/job.yaml"),
    ],
)
def test_bad_input_exits_nonzero_with_one_line(args, culprit, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "groupflow.cli",
            "train",
            *args,
            "--set",
            f"trainer.output_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and culprit in lines[0], proc.stderr
