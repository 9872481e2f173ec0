"""The job's one restart budget: engines and learner ranks draw on the same one.

Every death the job repairs is one restart: an engine replaced by the generator pool, or the
learner ranks rebuilt from a checkpoint after one of them died (the ranks go down together, so
a rank's death is one restart however many ranks are rebuilt). More than
`trainer.max_restarts` restarts without a new step trained in between end the job in one line:
a fault that recurs (an engine killed on every start, a rank that dies in the same step after
each rebuild) must not loop forever. A step trained again after a rebuild is not new, so
deaths on either side add up until the job gets past where it was.
"""

from __future__ import annotations

from collections.abc import Mapping

from groupflow.core.errors import UserError

KINDS = ("engine", "learner")


class LearnerLost(RuntimeError):
    """A learner rank died: the ranks must be rebuilt from a checkpoint."""


class RestartsExhausted(UserError, RuntimeError):
    """Too many restarts without progress: a problem of the cluster or the machine."""

    exit_code = 1


class RestartBudget:
    def __init__(self, max_in_a_row: int):
        self.max_in_a_row = max_in_a_row
        self.totals = dict.fromkeys(KINDS, 0)  # restarts over the whole run, by kind
        self.in_a_row = 0
        self._furthest_step = 0

    def charge(self, kind: str, cause: str) -> None:
        """Count one restart of `kind` ("engine" or "learner"); RestartsExhausted when it is
        one too many, naming `cause`."""
        self.totals[kind] += 1
        self.in_a_row += 1
        if self.in_a_row > self.max_in_a_row:
            raise RestartsExhausted(
                f"{cause}: {self.in_a_row} restarts without a new step trained between "
                f"(trainer.max_restarts={self.max_in_a_row})"
            )

    def step_done(self, step: int) -> None:
        """A step was trained: one past the furthest so far gives the budget back."""
        if step > self._furthest_step:
            self._furthest_step = step
            self.in_a_row = 0

    @property
    def engines(self) -> int:
        return self.totals["engine"]

    def state_dict(self) -> dict[str, float]:
        """The running totals as the step records and a checkpoint's counters name them."""
        return {f"{kind}_restarts": count for kind, count in self.totals.items()}

    def load_state_dict(self, counters: Mapping[str, float]) -> None:
        """Go on from a checkpoint's counters. Restarts only add up: a rebuild from an older
        checkpoint keeps the restarts counted since it was saved."""
        for kind in KINDS:
            saved = int(counters.get(f"{kind}_restarts", 0))
            self.totals[kind] = max(self.totals[kind], saved)
