"""Failures that are not the model's, kept out of the statistics (docs/agents.md, "Failures that
are not the model's").

A response whose verdict carries an error was never judged: its environment or a tool worker
failed under it (the reward side turns `Response.infra_failure` into such a verdict,
reward_workers/scorer.py), or the verifier itself raised, died or timed out. Its reward 0 says
nothing about the answer, and counted in its group it would push down every valid member
that scored above the failures' 0. Such a response is masked: it is left out of its group's
mean and std, out of the loss and of every denominator, as if it had never been sampled, and
counted by its reason. A group left with fewer than two valid members carries no comparison
and is dropped. A wrong answer is a verdict without an error: it stays a 0 and is trained on.

Past `reward.max_infra_failure_share` of a step's responses the job warns once; past it in
`STEPS_TO_STOP` steps in a row, it stops with one line naming the commonest reason.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from groupflow.config import Config
from groupflow.core.errors import UserError
from groupflow.core.records import Response, ScoredGroup, Verdict

log = logging.getLogger(__name__)

STEPS_TO_STOP = 3  # steps in a row past the share before the job stops
MIN_VALID = 2  # fewer valid members than this: no comparison within the group


class InfraFailureError(UserError):
    """Responses failed for reasons not the model's, in too large a share, for several steps."""

    exit_code = 1  # the cluster's or the environment's problem, not the input's


def failure_reason(response: Response, verdict: Verdict) -> str | None:
    """Why `response` was never judged, or None when its verdict stands (a wrong answer too).
    An environment's failure is the response's own reason (`Response.infra_failure`:
    environment_error, environment_deadline, tool_worker_lost); a verifier's is
    verifier_error or verifier_timeout (a reward worker lost or past its budget included)."""
    if verdict.error is None:
        return None
    if verdict.error == "environment":
        return response.infra_failure or "environment_error"
    return f"verifier_{verdict.error}"


def valid_rewards(group: ScoredGroup) -> list[float]:
    """The rewards of the group's members that were judged."""
    return [
        v.reward
        for r, v in zip(group.group.responses, group.verdicts, strict=True)
        if failure_reason(r, v) is None
    ]


@dataclass
class MaskedStep:
    """A step's groups with their failed members masked: `groups` what is trained on (each
    with its valid members only, groups of fewer than MIN_VALID left out), `kept[g][j]`
    whether response j of taken group g is in it."""

    groups: list[ScoredGroup]
    kept: list[list[bool]]
    failures: Counter[str] = field(default_factory=Counter)
    groups_dropped: int = 0
    responses: int = 0

    @property
    def share(self) -> float:
        return sum(self.failures.values()) / self.responses if self.responses else 0.0

    def spread(self, advantages: list[list[float]]) -> list[list[float]]:
        """The advantages of `groups`, laid out over every taken response (0 where masked)."""
        trained = iter(advantages)
        out = []
        for kept in self.kept:
            values = iter(next(trained)) if any(kept) else iter(())
            out.append([next(values) if k else 0.0 for k in kept])
        return out

    def figures(self) -> dict:
        return {
            "infra_failures": dict(self.failures),
            "groups_dropped_infra": self.groups_dropped,
            "infra_failure_share": self.share,
        }


def mask_failures(groups: Sequence[ScoredGroup]) -> MaskedStep:
    """`groups` with the members that failed for reasons not the model's taken out."""
    step = MaskedStep([], [])
    for sg in groups:
        reasons = [
            failure_reason(r, v) for r, v in zip(sg.group.responses, sg.verdicts, strict=True)
        ]
        step.failures.update(r for r in reasons if r is not None)
        step.responses += len(reasons)
        kept = [r is None for r in reasons]
        if sum(kept) < MIN_VALID:
            step.groups_dropped += 1
            step.kept.append([False] * len(kept))
            continue
        step.kept.append(kept)
        if all(kept):
            step.groups.append(sg)
            continue
        responses = [r for r, k in zip(sg.group.responses, kept, strict=True) if k]
        verdicts = [v for v, k in zip(sg.verdicts, kept, strict=True) if k]
        step.groups.append(ScoredGroup(replace(sg.group, responses=responses), verdicts))
    return step


class InfraFailures:
    """The job's rule: masks each step's failures, warns once past
    `reward.max_infra_failure_share`, stops past it
    in STEPS_TO_STOP steps in a row; a step with fewer groups left than the learner cuts a step
    into (`learner.mini_batches_per_step`) is taken again, as one never scored is."""

    def __init__(self, cfg: Config):
        self.max_share = cfg.reward.max_infra_failure_share
        self.min_groups = cfg.learner.mini_batches_per_step
        self.in_a_row = 0
        self.warned = False

    def mask(self, groups: Sequence[ScoredGroup]) -> MaskedStep | None:
        """The step masked, or None when too few groups are left to train on (take new ones).
        Raises InfraFailureError at the STEPS_TO_STOP-th step in a row past the share."""
        step = mask_failures(groups)
        if step.share > self.max_share:
            self._past_share(step)
        else:
            self.in_a_row = 0
        if len(step.groups) < self.min_groups:
            log.warning(
                "step not trained: %d of its %d groups left after masking %d failures not the "
                "model's (%s); taking new groups",
                len(step.groups),
                len(groups),
                sum(step.failures.values()),
                _counts(step.failures),
            )
            return None
        return step

    def _past_share(self, step: MaskedStep) -> None:
        self.in_a_row += 1
        failed = sum(step.failures.values())
        what = (
            f"{failed} of {step.responses} responses failed for reasons not the model's "
            f"({_counts(step.failures)}), past reward.max_infra_failure_share={self.max_share:g}"
        )
        if self.in_a_row >= STEPS_TO_STOP:
            reason = step.failures.most_common(1)[0][0]
            raise InfraFailureError(
                f"{reason}: {what} in {self.in_a_row} steps in a row; the environment, the "
                "tool workers or the verifier fail, not the model (see the step records' "
                "infra_failures)"
            )
        if not self.warned:
            self.warned = True
            log.warning("%s: masked, not trained on; the job stops if it persists", what)


def _counts(failures: Counter[str]) -> str:
    return ", ".join(f"{reason} {n}" for reason, n in failures.most_common())
