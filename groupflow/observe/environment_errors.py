"""Environments that fail and tool calls that time out, said where they happen rather than
left to show as rewards of 0.

A multi-turn trajectory whose environment raises ends `environment_error` and scores 0
(rollout/trajectory.py); a tool call past agent.tool_timeout_s is a timeout the model reads as
the call's result. A step record counts both (`end_reasons`, `tool_timeouts`,
groupflow/observe/rollout_figures.py). An environment that fails every step would otherwise
show only as all-zero rewards, 15 minutes later, in an alert about rewards.

`TroubleWatch` is a step sink that warns while a job runs (deploy/alerts.yml alerts on the same
counts); `environment_verdict` is what `groupflow eval` says of its answers: a warning when some
ended `environment_error`, an error when most did, since the scores then measure the
environment, not the model.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from groupflow.core.errors import RunError, printable
from groupflow.core.records import SampledGroup

log = logging.getLogger(__name__)

ENVIRONMENT_ERROR = "environment_error"  # the end reason (rollout/trajectory.py)

_WHERE = "each error is in samples/step_<N>.jsonl with trainer.log_samples_every"


class _Streak:
    """Steps with trouble of one kind: the first is said, then each time their count doubles,
    so a job that fails every step costs a few lines, not one a step."""

    def __init__(self):
        self.steps = 0
        self._say_at = 1

    def due(self) -> bool:
        self.steps += 1
        if self.steps < self._say_at:
            return False
        self._say_at *= 2
        return True


class TroubleWatch:
    """A step sink: warns of a step's trajectories that ended `environment_error` and of its
    tool calls that timed out, naming the setting to look at: `setting` is the one whose code
    runs the trajectories (agent.environment or agent.harness)."""

    def __init__(self, setting: str):
        self._setting = setting
        self._environment = _Streak()
        self._timeouts: dict[str, _Streak] = {}

    def write(self, record: dict) -> None:
        step = record.get("step")
        reasons = record.get("end_reasons") or {}
        failed = reasons.get(ENVIRONMENT_ERROR, 0)
        if failed and self._environment.due():
            log.warning(
                "step %s: %d of %d trajectories ended %s (masked: not trained on), in %d "
                "steps so far: check %s (%s)",
                step,
                failed,
                sum(reasons.values()),
                ENVIRONMENT_ERROR,
                self._environment.steps,
                self._setting,
                _WHERE,
            )
        calls = record.get("tool_calls") or {}
        for tool, timeouts in sorted((record.get("tool_timeouts") or {}).items()):
            streak = self._timeouts.setdefault(tool, _Streak())
            if timeouts and streak.due():
                log.warning(
                    "step %s: %d of %d calls of tool %r timed out at agent.tool_timeout_s, in "
                    "%d steps so far: a tool that hangs, or a limit too short for it",
                    step,
                    timeouts,
                    calls.get(tool, timeouts),
                    printable(str(tool)),
                    streak.steps,
                )


def environment_verdict(groups: Sequence[SampledGroup], setting: str) -> dict:
    """{'environment_errors': count} of answers that ended `environment_error` (empty when
    none did, with a warning when some did); RunError naming the first error when most did.
    `setting` is the one whose code runs the trajectories (agent.environment or agent.harness)."""
    responses = [r for g in groups for r in g.responses]
    failed = [r for r in responses if r.end_reason == ENVIRONMENT_ERROR]
    if not failed:
        return {}
    first = printable(" ".join(str(failed[0].error or "").split()))[:200]
    said = (
        f"{len(failed)} of {len(responses)} held-out answers ended {ENVIRONMENT_ERROR} "
        f"(first: {first or 'no message'})"
    )
    if 2 * len(failed) > len(responses):
        raise RunError(f"{said}: the scores would measure {setting}, not the model; fix {setting}")
    log.warning("%s: they scored 0; check %s", said, setting)
    return {"environment_errors": len(failed)}
