"""Never train on nothing: a step whose groups were all left unscored is not trained on.

A response is unscored when its verdict carries an error (the reward worker timed out or was
lost, the verifier timed out or failed): its reward 0 says nothing about the answer. A step
made only of such responses would train the policy on noise with every advantage 0, and the
job would look alive while learning nothing (reward workers that Ray cannot place time out
on every batch). The job takes that step's groups again instead; `reward.max_unscored_steps`
such takes in a row stop the job with one line naming the cause.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

from groupflow.core.errors import UserError
from groupflow.core.records import ScoredGroup

log = logging.getLogger(__name__)


class UnscoredError(UserError):
    """The reward pool scored nothing for several steps in a row."""

    exit_code = 1  # the cluster's problem, not the input's


def unscored_reason(groups: Sequence[ScoredGroup]) -> str | None:
    """The commonest reason when no response of `groups` was scored; None when one was (or
    when there are none: an empty step has nothing to say about the reward pool)."""
    verdicts = [v for g in groups for v in g.verdicts]
    if not verdicts or any(v.error is None for v in verdicts):
        return None
    return Counter(v.reason for v in verdicts).most_common(1)[0][0]


class UnscoredSteps:
    """Counts steps in a row whose groups were all unscored; raises at `limit`."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_a_row = 0

    def trainable(self, groups: Sequence[ScoredGroup]) -> bool:
        """Whether the step may train on `groups`; False means take new ones. Raises
        UnscoredError at the `limit`-th unscored take in a row."""
        reason = unscored_reason(groups)
        if reason is None:
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        if self.in_a_row >= self.limit:
            raise UnscoredError(
                f"no response was scored in {self.in_a_row} steps in a row "
                f"(reward.max_unscored_steps={self.limit}; {reason}): the reward workers are "
                "not placed on the cluster, or time out (reward.timeout_s); see "
                "`groupflow status` and reward.resources"
            )
        log.warning(
            "step not trained: none of its %d groups was scored (%s); taking new groups "
            "(%d of reward.max_unscored_steps=%d)",
            len(groups),
            reason,
            self.in_a_row,
            self.limit,
        )
        return False
