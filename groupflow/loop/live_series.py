"""What the job shows while it runs, beside its step records: the live status (`groupflow
status`), the live Prometheus series (queue depths, live and pending actors), and one line for
a step that has waited long. Published after each step and, while a step waits, at every
heartbeat of the job loop's one wait (groupflow/loop/pipeline.py), so a stalled step is seen while
it stalls.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from groupflow.core.peers import Generation, Learner, Scoring
from groupflow.core.scaling_protocol import LiveStatus
from groupflow.loop.scaling import Scaler
from groupflow.observe.prometheus import PrometheusExporter

log = logging.getLogger(__name__)

# A step that has waited this long (and three times the last step) is said once, with what
# the pools have: the moment a user wonders whether the job hangs.
STALL_NOTE_S = 60.0


class LiveSeries:
    def __init__(
        self,
        generators: Generation,
        rewards: Scoring,
        learner: Learner,
        scaler: Scaler | None,
        exporter: PrometheusExporter | None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.generators, self.rewards, self.learner = generators, rewards, learner
        self.scaler, self.exporter, self.clock = scaler, exporter, clock
        self._done = 0  # the last step trained, which the status reports
        self._started = clock()
        self._last_step_s = 0.0
        self._stall_said = False

    def step_started(self, step: int) -> None:
        self._done, self._started, self._stall_said = step - 1, self.clock(), False

    def step_ended(self, record: dict) -> None:
        self._done = int(record["step"])
        self._last_step_s = self.clock() - self._started
        if self.exporter is not None:
            self.exporter.observe_step(record)
        # The scaler published this step's status between steps (Scaler.between_steps).
        self.publish(with_status=self.scaler is None)

    def heartbeat(self) -> None:
        """While a step waits: publish, and say once that it has waited long, with what the
        pools have."""
        status = self.publish()
        waited = self.clock() - self._started
        if not self._stall_said and waited >= max(STALL_NOTE_S, 3 * self._last_step_s):
            self._stall_said = True
            pools = "" if status is None else ": " + "; ".join(status.lines()[1:])
            log.warning("step %d has waited %.0fs%s", self._done + 1, waited, pools)

    def publish(self, with_status: bool = True) -> LiveStatus | None:
        """The queue depths, and the pools' live and pending counts as `groupflow status`
        shows them (published by the scaler); the status published."""
        status = None
        if with_status and self.scaler is not None:
            status = self.scaler.publish(self._done)
        if self.exporter is not None:
            rollout = self.generators.figures()
            self.exporter.set_queue_depth("generation", rollout.queued_prompts)
            self.exporter.set_queue_depth("reward", self.rewards.pending_groups())
            if self.scaler is None:
                self.exporter.set_cluster(
                    rollout.engines, self.rewards.num_workers, self.learner.num_ranks
                )
        return status
