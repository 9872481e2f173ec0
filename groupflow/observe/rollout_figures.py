"""The step record's rollout figures: rewards, lengths, staleness, stage times, throughput.

The learner's figures come from groupflow.learner.figures.learner_record; every key is
described in groupflow/observe/catalogue.py.
"""

from __future__ import annotations

import statistics
from collections import Counter

from groupflow.core.records import Response, ScoredGroup
from groupflow.core.timing import time_keys


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def rollout_record(
    scored: list[ScoredGroup],
    staleness: list[int],
    times: dict[str, float],
    sampled: list[ScoredGroup] | None = None,
) -> dict[str, float | dict[str, float]]:
    """Figures of the groups a step trained on; `staleness` holds one entry per sequence and
    `times` the step's stage times so far (groupflow.core.timing). The trajectories' figures
    count every response `sampled` (default: those trained on), the masked ones too
    (groupflow/loop/infra_failures.py): their tool calls and end reasons happened."""
    rewards = [r for g in scored for r in g.rewards]
    lengths = [len(resp.token_ids) for g in scored for resp in g.group.responses]
    tokens = sum(lengths)
    record = {
        "reward_mean": statistics.fmean(rewards) if rewards else 0.0,
        "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "accuracy": _ratio(sum(r >= 1.0 for r in rewards), len(rewards)),
        "response_len_mean": statistics.fmean(lengths) if lengths else 0.0,
        "tokens_generated": tokens,
        "num_groups": len(scored),
        "groups_with_spread": sum(len(set(g.rewards)) > 1 for g in scored),
        "num_sequences": len(lengths),
        "staleness_mean": statistics.fmean(staleness) if staleness else 0.0,
        "staleness_max": max(staleness, default=0),
        # The learner trains on every response token of the step once.
        "gen_tokens_per_s": _ratio(tokens, times.get("gen", 0.0)),
        "learn_tokens_per_s": _ratio(tokens, times.get("learn", 0.0)),
    }
    if any(g.group.prompt.task for g in scored):  # several tasks in one job
        record.update(_per_task(scored))
    responses = [r for g in (scored if sampled is None else sampled) for r in g.group.responses]
    if any(r.end_reason is not None for r in responses):  # a multi-turn job
        record.update(agent_figures(responses))
    record.update(time_keys(times))
    return record


# Labels of tool calls that name no declared tool: the model's own words must not become
# series of their own (each would be a Prometheus series forever).
MALFORMED_CALL, UNKNOWN_TOOL = "(malformed)", "(unknown)"


def agent_figures(responses: list[Response]) -> dict:
    """Turns, tool use, observations and end reasons of a step's trajectories."""
    calls: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    timeouts: Counter[str] = Counter()
    latencies = []
    for r in responses:
        for use in r.tool_uses:
            tool = {"malformed": MALFORMED_CALL, "unknown": UNKNOWN_TOOL}.get(use.outcome, use.tool)
            calls[tool] += 1
            if use.outcome == "timeout":
                timeouts[tool] += 1
            elif use.outcome != "ok":
                errors[tool] += 1
            if use.outcome in ("ok", "error", "timeout"):  # the tool ran
                latencies.append(round(use.seconds, 4))
    tokens = sum(len(r.token_ids) for r in responses)
    observed = sum(len(r.loss_mask) - sum(r.loss_mask) for r in responses if r.loss_mask)
    return {
        "turns_mean": statistics.fmean(r.turns for r in responses),
        "tool_use_rate": _ratio(sum(bool(r.tool_uses) for r in responses), len(responses)),
        "observation_token_share": _ratio(observed, tokens),
        "tool_calls": dict(calls),
        "tool_errors": dict(errors),
        "tool_timeouts": dict(timeouts),
        "tool_latency_s": latencies,
        "end_reasons": dict(Counter(r.end_reason or "answer" for r in responses)),
        "event_loop_blocks": sum(r.loop_blocks for r in responses),
        "trajectory_splits": sum(len(r.earlier) for r in responses),
    }


def _per_task(scored: list[ScoredGroup]) -> dict[str, dict[str, float]]:
    rewards: dict[str, list[float]] = {}
    for g in scored:
        rewards.setdefault(g.group.prompt.task or "", []).extend(g.rewards)
    return {
        "task_reward_mean": {t: statistics.fmean(r) for t, r in rewards.items()},
        "task_accuracy": {t: _ratio(sum(x >= 1.0 for x in r), len(r)) for t, r in rewards.items()},
    }
