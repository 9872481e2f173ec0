"""The algorithm presets end to end, one per path, each with its riders on a job that another
test starts anyway (a job's start costs far more than a few steps of any preset): DFPO, Lopti
and GSPO on the long-tail runs (tests/integration/test_long_tail.py), STAPO and DAPO together on
the submitted quickstart that loses its engines' node (tests/integration/test_jobs.py). Here:
what each preset's run is given (`preset_settings`) and what it must show (`check_preset_run`)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from groupflow.config.presets import PRESETS

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


# Every preset's learner step is checked against a direct computation on threaded ranks
# (tests/unit/test_learner_step.py, test_off_policy.py). End to end, one preset per path
# through the driver and the real DeepSpeed backward: dynamic sampling with asymmetric
# clipping, sequence-level ratios, STAPO's masking, Lopti's two updates per mini-batch and
# DFPO's exact cancellation; the baseline (grpo, the quickstart's) is the three-step run of
# tests/integration/test_e2e.py, with its riders. (AR, AR+Lopti, Dr. GRPO and 20-Entropy
# differ from these only inside the credit plan or the advantage estimator.)
END_TO_END = ["dapo", "dfpo", "gspo", "lopti", "stapo"]
# The long-tail runs' presets, by their staleness bound: DFPO's exact cancellation needs
# on-policy samples, and GSPO's riders a stale step.
ON_LONG_TAIL = {0: "dfpo", 1: "lopti", 2: "gspo"}
# The presets whose runs train the small Qwen3-MoE (groupflow/run/small_moe.py) instead of the
# quickstart model, after every load the engines' sync probe agreeing with the learner's to
# float noise (docs/moe.md): GSPO's, whose partial rollouts straddle weight loads at staleness
# 2, with routing replay; DFPO's, on-policy, with the routings compared but not replayed.
ON_THE_MIXTURE_OF_EXPERTS = ["dfpo", "gspo"]
# The submitted job, which loses its engines' node: STAPO's preset with DAPO's laid over it.
# They agree on what both set (clipping; the loss's token mean) and each adds its own path,
# STAPO's silencing (all-reduced over the job's two learner ranks) and DAPO's dynamic
# sampling (through the lost node too), so the run is each preset whole.
ON_SUBMITTED_JOB = ("stapo", "dapo")


def test_every_end_to_end_preset_has_a_run():
    assert set(END_TO_END) <= PRESETS.keys()
    runs = [*ON_LONG_TAIL.values(), *ON_SUBMITTED_JOB]
    assert sorted(runs) == END_TO_END


# Options that ride along on a preset's run, so that each goes through the CLI on the real
# stack without a run of its own.
RIDERS = {
    "dapo": [  # DAPO's overlong filtering and soft punishment
        "algorithm.mask_truncated=true",
        "reward.overlong_penalty.buffer_tokens=4",
        # several micro-batches a mini-batch in the real DeepSpeed backward, each planned from
        # its own forward (learner/step.py)
        "learner.micro_batch_tokens=96",
    ],
    "dfpo": [  # on the small mixture of experts (ON_THE_MIXTURE_OF_EXPERTS)
        # the engines return their routing and the learner compares its own with it
        "learner.moe.routing_replay=observe",
    ],
    "gspo": [  # on the small mixture of experts (ON_THE_MIXTURE_OF_EXPERTS)
        "rollout.sampling.top_k=20",
        "rollout.sampling.min_p=0.01",
        "rollout.sampling.seed=3",
        "learner.moe.aux_loss_coef=0.01",  # the load-balancing loss, in the real backward
        # rollout routing replay: the engines return each token's experts and the learner's
        # forwards route through them (docs/moe.md)
        "learner.moe.routing_replay=rollout",
        # and its long-tail run's trainer.max_staleness=2: the first two steps' prompts are
        # drawn at once, the second step's stale
    ],
    "stapo": [
        "metrics.loggers=[wandb]",
        "metrics.wandb_mode=offline",
        "learner.micro_batch_tokens=96",  # several micro-batches, planned as a whole
        # the threshold from the running probability histogram, all-reduced over the ranks:
        # on the quickstart's 3-token answers a fixed 0.002 finds no candidate at all, and so
        # may a small share (the threshold is its bin's lower edge, and the lowest nonempty
        # bin of a few dozen tokens often holds more than 5% of them): at the median, the
        # tokens of the bins below it are candidates whatever the samples
        "algorithm.stapo.tau_p=auto",
        "algorithm.stapo.target_share=0.5",
        "learner.num_ranks=2",  # the quickstart's: the histogram is all-reduced between them
    ],
}


def preset_settings(preset: str, *also: str) -> list[str]:
    """The --set overrides of a preset's run: the preset, two mini-batches a step, its riders,
    and one learner rank unless a rider asks for more (a rank's start costs about as much CPU
    as the engine's; the presets' steps are checked against threaded ranks in the unit tests,
    and the quickstart's two DeepSpeed ranks train in test_e2e.py and test_recovery.py). The
    presets `also` are laid over it key by key, each with its riders; one that contradicts it
    is refused (the run would be neither)."""
    own = _settings_of(PRESETS[preset])
    laid = {}
    for other in also:
        for key, value in _settings_of(PRESETS[other]).items():
            assert own.get(key, value) == value, f"{other} contradicts {preset} on {key}"
            laid[key] = value
    return [
        f"algorithm.preset={preset}",
        "learner.mini_batches_per_step=2",
        "learner.num_ranks=1",
        *(
            f"{key}={str(value).lower() if isinstance(value, bool) else value}"
            for key, value in laid.items()
        ),
        *(rider for p in (preset, *also) for rider in RIDERS.get(p, [])),
    ]


def _settings_of(section: dict, prefix: str = "algorithm.") -> dict[str, object]:
    """A preset's partial `algorithm` section as dotted keys."""
    out = {}
    for key, value in section.items():
        if isinstance(value, dict):
            out.update(_settings_of(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def check_preset_run(preset: str, records: list[dict], run_dir: Path) -> None:
    """What a preset's run shows in its step records and run directory."""
    for r in records:
        assert DIAGNOSTICS <= r.keys(), DIAGNOSTICS - r.keys()
        assert 0.0 <= r["spurious_frac"] <= 1.0 and 0.0 <= r["cancellation_residual"] <= 1.0
        # Lopti updates twice per mini-batch (low-probability tokens first), others once
        two_stage = PRESETS[preset].get("lopti", {}).get("enabled", False)
        assert r["optimizer_updates"] == 2 * (2 if two_stage else 1), preset
    # the loads probed since the previous step agree to float noise (float32 here); a load
    # that a later one overtakes before its engine scores the probe goes unprobed
    probed = [r for r in records if "sync_probe_diff_max" in r]
    assert probed and all(r["weight_sync_verified"] > 0 for r in probed), preset
    assert all(r["sync_probe_diff_max"] < 1e-5 for r in probed), [
        (r["sync_probe_diff_mean"], r["sync_probe_diff_max"]) for r in probed
    ]
    if preset == "gspo":
        assert [r["staleness_max"] for r in records[:2]] == [0, 1]
        # routing replay: every trained sequence came with the engine's routing of each token
        # its trained tokens follow (the learner stops the job otherwise), and the learner's
        # own routers were compared with it on every one of them
        assert all(0.0 <= r["routing_disagreement"] <= 1.0 for r in records)
        # the small MoE's routing (2 layers, 8 experts, top-2), under the load-balancing loss:
        # an expert gets each token once at most, so its load is at most E / k = 4 times the
        # mean; the loss is k = 2 when balanced, at most E = 8; and the log-prob mismatch is
        # reported for the mixture of experts as for a dense model
        for r in records:
            balance = r["expert_load_max_over_mean"]
            assert sorted(balance) == ["0", "1"] and all(1.0 <= b <= 4.0 for b in balance.values())
            assert 1.0 < r["moe_aux_loss"] <= 8.0, r["moe_aux_loss"]
            # (not small here: the long-tail workload forces each response's length with
            # min_tokens, which masks EOS, and the engines return the log-probs of the
            # distribution they sampled from, processed_logprobs: every long-tail run, dense
            # or not, replayed or not, shows 0.4-1.2 nats)
            assert math.isfinite(r["logp_mismatch_mean"]) and r["logp_mismatch_mean"] >= 0.0
        assert all(r["groups_dropped_stale"] == 0 for r in records)
    if preset == "stapo":
        assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
        # tau_p: auto puts under half of the examined tokens below a threshold in (0, 1): STAPO acts
        assert all(0.0 < r["stapo_tau_p"] < 1.0 for r in records)
        assert any(r["spurious_frac"] > 0 and r["stapo_silenced_frac"] > 0 for r in records)
    if preset == "dfpo":
        # routing observed: the engines' routing came with the trained sequences and the
        # learner compared its own routers' choice with it, without replaying it
        assert all(0.0 <= r["routing_disagreement"] <= 1.0 for r in records)
        # linear loss, group-orthogonalised weights, token_mean: prefixes shared by the whole
        # group get exactly cancelling gradients in the real DeepSpeed backward
        assert all(r["cancellation_residual_whole_group"] < 1e-6 for r in records)
