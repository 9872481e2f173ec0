"""Whether a job has anything to learn from: groups whose rewards differ.

A response's advantage is its reward measured against its group's, so a group whose rewards
are all equal (every answer wrong, or every one right) teaches nothing, and a step without a
group whose rewards differ (`groups_with_spread` of its record is 0) leaves the reward's part of
the update at zero. Such steps in a row mean that the verifier never matches the gold answers
(every reward 0), or that the task is out of the model's reach or already mastered.

`SpreadWatch` is a step sink that warns while the job runs; `nothing_learned` is the end line
of a run none of whose steps had a reward spread.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

log = logging.getLogger(__name__)

# Steps in a row without a reward spread before the first warning; it repeats each time the
# run of such steps doubles, so a long one costs a few lines.
NO_SPREAD_WARN_AFTER = 5

_ZERO_HINT = (
    "does the verifier find the gold answer? (the reason of each reward is in "
    "samples/step_<N>.jsonl with trainer.log_samples_every; docs/verifiers.md; a worked "
    "solution as the gold answer needs the dataset's fields.answer_format)"
)
_SOLVED_HINT = "the model answers every prompt right already: take harder prompts"
_ALIKE_HINT = (
    "every group's answers score alike: the prompts are out of the model's reach or already "
    "mastered; harder or easier prompts, a larger rollout.group_size, or "
    "algorithm.dynamic_sampling (which replaces such groups) help"
)


def _what_and_hint(records: Sequence[dict]) -> tuple[str, str]:
    """The rewards of steps without a spread, and what to look at."""
    means = {r.get("reward_mean") for r in records}
    one_value = all(r.get("reward_std") == 0 for r in records) and len(means) == 1
    if one_value:
        (value,) = means
        if isinstance(value, int | float) and math.isclose(value, 0.0, abs_tol=1e-12):
            return "every reward was 0", _ZERO_HINT
        if isinstance(value, int | float) and value >= 1.0:
            return f"every reward was {value:g}", _SOLVED_HINT
        return f"every reward was {value}", _ALIKE_HINT
    return "rewards differed between groups only", _ALIKE_HINT


class SpreadWatch:
    """A step sink: warns when `warn_after` steps in a row (then 2x, 4x ... as many) had no
    group whose rewards differ, saying what the rewards were and what to check."""

    def __init__(self, warn_after: int = NO_SPREAD_WARN_AFTER):
        self.warn_after = warn_after
        self.streak: list[dict] = []
        self._warn_at = warn_after

    def write(self, record: dict) -> None:
        if record.get("groups_with_spread", 1):  # a record without the key says nothing
            self.streak, self._warn_at = [], self.warn_after
            return
        self.streak.append({key: record.get(key) for key in ("step", "reward_mean", "reward_std")})
        n = len(self.streak)
        if n < self._warn_at:
            return
        self._warn_at *= 2
        what, hint = _what_and_hint(self.streak)
        log.warning(
            "steps %s-%s: no group's rewards differed in %d steps in a row (%s): the rewards "
            "gave these steps nothing to learn from; %s",
            self.streak[0].get("step"),
            self.streak[-1].get("step"),
            n,
            what,
            hint,
        )


def nothing_learned(records: Sequence[dict]) -> str | None:
    """The end line of a run whose steps never had a group with a reward spread (among the
    records that count such groups); None when one had, or when no record counts them."""
    counted = [r for r in records if "groups_with_spread" in r]
    if not counted or any(r["groups_with_spread"] for r in counted):
        return None
    what, hint = _what_and_hint(counted)
    return (
        f"NOTHING LEARNED: in none of the {len(counted)} steps did a group's rewards differ "
        f"({what}): the rewards gave the run nothing to learn from; {hint}"
    )
