"""Every algorithm preset trains 2 steps end to end through the CLI entry point."""

from __future__ import annotations

import json

import pytest

from groupflow.cli import main
from learner.presets import PRESETS

pytestmark = pytest.mark.integration

DIAGNOSTICS = {
    "entropy_mean",
    "entropy_pos",
    "entropy_neg",
    "clip_frac_low",
    "clip_frac_high",
    "approx_kl",
    "spurious_frac",
    "lowprob_frac",
    "lowprob_grad_share",
    "cancellation_residual",
}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_trains_two_steps(preset, ray_cluster, quickstart_model, tmp_path):
    code = main(
        [
            "train",
            "--set",
            f"algorithm.preset={preset}",
            "--set",
            f"trainer.output_dir={tmp_path}",
            "--set",
            f"trainer.run_name={preset}",
            "--set",
            "trainer.steps=2",
            "--set",
            "task.eval_size=16",
            "--set",
            "rollout.prompts_per_step=16",
            "--set",
            "learner.mini_batches_per_step=2",
        ]
    )
    assert code == 0
    records = [
        json.loads(x) for x in (tmp_path / preset / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(records) == 2
    for r in records:
        assert DIAGNOSTICS <= r.keys(), DIAGNOSTICS - r.keys()
        assert 0.0 <= r["spurious_frac"] <= 1.0 and 0.0 <= r["cancellation_residual"] <= 1.0
        # Lopti updates twice per mini-batch (low-probability tokens first), others once
        two_stage = PRESETS[preset].get("lopti", {}).get("enabled", False)
        assert r["optimizer_updates"] == (4 if two_stage else 2)
    if preset == "dfpo":
        # linear loss, group-orthogonalised weights, token_mean: prefixes shared by the whole
        # group get exactly cancelling gradients in the real DeepSpeed backward
        assert all(r["cancellation_residual_whole_group"] < 1e-6 for r in records)


def test_kl_to_a_reference_and_an_entropy_bonus_train(ray_cluster, quickstart_model, tmp_path):
    """kl.coef > 0 loads the frozen reference on every rank; the entropy bonus backpropagates."""
    code = main(
        [
            "train",
            "--set",
            "algorithm.kl.coef=0.05",
            "--set",
            "algorithm.kl.estimator=k3",
            "--set",
            "algorithm.entropy_coef=0.01",
            "--set",
            "learner.optimizer.lr=1e-3",
            "--set",
            f"trainer.output_dir={tmp_path}",
            "--set",
            "trainer.run_name=kl",
            "--set",
            "trainer.steps=2",
            "--set",
            "task.eval_size=16",
            "--set",
            "rollout.prompts_per_step=16",
        ]
    )
    assert code == 0
    first, second = [
        json.loads(x) for x in (tmp_path / "kl" / "metrics.jsonl").read_text().splitlines()
    ]
    assert first["kl_ref"] == 0.0  # the policy is the reference until its first update
    assert second["kl_ref"] > 0.0
