"""The learner's figures of one step, combined from the ranks' results."""

from __future__ import annotations

import math
import statistics

import torch

from groupflow.learner.diagnostics import cancellation_residual


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def learner_record(results: list) -> dict[str, float]:
    """The step record's learner keys from every rank's StepResult."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for res in results:
        for key, value in res.sums.items():
            sums[key] = (
                max(sums.get(key, 0.0), value)
                if key.endswith("_max")
                else sums.get(key, 0.0) + value
            )
        for key, value in res.counts.items():
            counts[key] = counts.get(key, 0.0) + value
    # The planner's figures are already global over ranks: take rank 0's, averaged over mini-batches.
    plan_stats = results[0].plan_stats if results else []
    plan_mean = {
        k: statistics.fmean(p[k] for p in plan_stats) for k in (plan_stats[0] if plan_stats else {})
    }
    by_group: dict[int, list] = {}
    for res in results:
        for gid, ids, grads in res.token_grads:
            by_group.setdefault(gid, []).append((ids, torch.tensor(grads, dtype=torch.float64)))
    grad_norms = [g for res in results[:1] for g in res.grad_norms if not math.isnan(g)]
    record = {
        "entropy_mean": _ratio(sums.get("entropy", 0.0), counts.get("tokens", 0.0)),
        "entropy_pos": _ratio(sums.get("entropy_pos", 0.0), counts.get("tokens_pos", 0.0)),
        "entropy_neg": _ratio(sums.get("entropy_neg", 0.0), counts.get("tokens_neg", 0.0)),
        "clip_frac_low": _ratio(sums.get("clip_low", 0.0), counts.get("update_tokens", 0.0)),
        "clip_frac_high": _ratio(sums.get("clip_high", 0.0), counts.get("update_tokens", 0.0)),
        "approx_kl": _ratio(sums.get("approx_kl", 0.0), counts.get("update_tokens", 0.0)),
        "kl_ref": _ratio(sums.get("kl_ref", 0.0), counts.get("update_tokens", 0.0)),
        "grad_norm": statistics.fmean(grad_norms) if grad_norms else 0.0,
        "optimizer_updates": results[0].optimizer_updates if results else 0,
        "logp_mismatch_mean": _ratio(sums.get("logp_mismatch", 0.0), counts.get("tokens", 0.0)),
        "logp_mismatch_max": sums.get("logp_mismatch_max", 0.0),
        "cancellation_residual": cancellation_residual(list(by_group.values())),
        # only nodes every response of the group passes through: exactly 0 when the
        # aggregation is exchangeable and nothing clips or masks by sign
        "cancellation_residual_whole_group": cancellation_residual(
            list(by_group.values()), whole_group=True
        ),
    }
    record["clip_frac"] = record["clip_frac_low"] + record["clip_frac_high"]
    record.update(plan_mean)
    return record
