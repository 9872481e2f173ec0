"""The reward pool's errors and timeouts over the whole run, in every step record.

The pool counts what happened since this driver started it; a resumed job adds what the
checkpoint it resumed from had counted, so the totals run on across restarts of the driver.
"""

from __future__ import annotations

from collections.abc import Mapping

from groupflow.core.peers import Scoring

KEYS = ("reward_errors", "reward_timeouts")


class RewardTotals:
    def __init__(self, rewards: Scoring):
        self.rewards = rewards
        self._before = dict.fromkeys(KEYS, 0.0)  # counted before this driver started

    def state_dict(self) -> dict[str, float]:
        """The totals as the step records and a checkpoint name them."""
        counted = {"reward_errors": self.rewards.errors, "reward_timeouts": self.rewards.timeouts}
        return {key: self._before[key] + counted[key] for key in KEYS}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        """Go on from a checkpoint's totals (a key it lacks counts from 0)."""
        self._before = {key: float(state.get(key, 0.0)) for key in KEYS}
