"""Scaling rollout while a job runs: the autoscale policy, and the Scaler that applies it and
the requests of `groupflow scale` to the pools between steps. The requests, their checks and
what the pools report are the control protocol (groupflow/core/scaling_protocol.py).

Nothing here imports Ray. Requests arrive through an `Inbox` (on Ray: the job's named control
actor, groupflow/actors/control.py, which `groupflow scale` calls); the pools start and retire
actors themselves (groupflow.core.peers.Generation/Scoring `scale_to` and `settle`), without
blocking: an actor that has no room on the cluster stays a pending resource request, which
the Ray autoscaler sees, and joins when it is placed and started.

The job loop calls `Scaler.between_steps(record)` once per step, after the step's record is
complete and before it is written: the pools only change between steps, never during a
weight sync (the engines list is shared with the weight transport).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from groupflow.core.scaling_protocol import (
    Inbox,
    LiveStatus,
    PoolState,
    ScalablePool,
)


# ----- autoscaling ----------------------------------------------------------------------------
@dataclass
class AutoscalePolicy:
    """Adds an engine when the learner waits for generation, removes one when the engines
    sit idle; within [min_engines, max_engines].

    Hysteresis, so that the count does not flap:
    - up when the learner waited for generation for at least `up_fraction` of the step;
    - down only when it waited at most `down_fraction`, and generation with one engine
      fewer (time_gen_s * n / (n - 1)) would still hide within `headroom` of the time the
      learner is busy: a removal must not bring the wait back;
    - either signal must hold `patience` steps in a row, and no decision is made while a
      change is under way (actors starting or retiring) nor for `cooldown_steps` after.
    """

    min_engines: int
    max_engines: int
    patience: int = 2
    cooldown_steps: int = 1
    up_fraction: float = 0.2
    down_fraction: float = 0.05
    headroom: float = 0.6
    _up: int = 0
    _down: int = 0
    _cooldown: int = 0

    def decide(self, record: Mapping[str, float], engines: int, settled: bool) -> int | None:
        """The new engine target after this step, or None to keep the count."""
        if not settled:
            self._up = self._down = 0
            self._cooldown = self.cooldown_steps
            return None
        if self._cooldown > 0:
            self._cooldown -= 1
            return None
        try:
            step_s = float(record["time_step_s"])
            waited = float(record.get("time_wait_rollout_s", 0.0))
            gen_s = float(record["time_gen_s"])
        except (KeyError, TypeError, ValueError):
            return None
        if step_s <= 0:
            return None
        busy_s = step_s - waited  # the learner's own time, over which generation can hide
        up = waited >= self.up_fraction * step_s and engines < self.max_engines
        down = (
            engines > self.min_engines
            and waited <= self.down_fraction * step_s
            and gen_s * engines / (engines - 1) <= self.headroom * busy_s
        )
        self._up = self._up + 1 if up else 0
        self._down = self._down + 1 if down else 0
        if self._up >= self.patience:
            self._up = 0
            return engines + 1
        if self._down >= self.patience:
            self._down = 0
            return engines - 1
        return None


# ----- applying requests between steps --------------------------------------------------------
class LiveGauges(Protocol):
    """The exporter's live series (groupflow.observe.prometheus.PrometheusExporter)."""

    def set_cluster(self, engines: int, reward_workers: int, learner_ranks: int) -> None: ...

    def set_pending(self, pool: str, count: int) -> None: ...


class Scaler:
    """Applies scale requests and the autoscale policy to the pools, between steps."""

    def __init__(
        self,
        run_name: str,
        engines: ScalablePool,
        rewards: ScalablePool,
        learner_ranks: int,
        inbox: Inbox | None = None,
        policy: AutoscalePolicy | None = None,
        gauges: LiveGauges | None = None,
        log: Callable[[str], None] = print,
    ):
        self.run_name = run_name
        self.engines = engines
        self.rewards = rewards
        self.learner_ranks = learner_ranks
        self.inbox = inbox
        self.policy = policy
        self.gauges = gauges
        self.log = log
        self.events: list[str] = []
        self.autoscale = (
            "off" if policy is None else f"on [{policy.min_engines}, {policy.max_engines}]"
        )

    def between_steps(self, record: Mapping[str, float]) -> dict[str, float]:
        """After a step: what the step ran with (for its record), then the pools changed
        toward the latest request or the policy's decision."""
        step = int(record.get("step", 0))
        eng, rew = self.engines.settle(), self.rewards.settle()
        # The record tells what served this step: the pool's actors during it, retiring ones
        # included (they finish what they hold), not those that joined in this settle (they
        # take work from the next step on).
        out = {
            "num_engines": eng.live + eng.retiring + eng.left - eng.joined,
            "num_reward_workers": rew.live + rew.retiring + rew.left - rew.joined,
        }
        events = self._changes(eng, "engine") + self._changes(rew, "reward worker")
        request = self.inbox.poll() if self.inbox is not None else None
        if request is not None:
            if request.engines is not None and self.policy is not None:
                # The person took over: autoscaling would undo their count.
                self.policy = None
                self.autoscale = "off (set by groupflow scale)"
            if request.engines is not None and request.engines != eng.target:
                events.append(f"engines target {eng.target} -> {request.engines} (request)")
                self.engines.scale_to(request.engines)
            if request.reward_workers is not None and request.reward_workers != rew.target:
                events.append(
                    f"reward workers target {rew.target} -> {request.reward_workers} (request)"
                )
                self.rewards.scale_to(request.reward_workers)
        elif self.policy is not None:
            settled = not (eng.starting or eng.pending or eng.retiring)
            target = self.policy.decide(record, eng.live, settled)
            if target is not None and target != eng.target:
                events.append(f"engines target {eng.target} -> {target} (autoscale)")
                self.engines.scale_to(target)
        if events:
            for event in events:
                self.log(f"step {step}: {event}")
            self.events = (self.events + [f"step {step}: {e}" for e in events])[-20:]
        out["scale_events"] = len(events)
        self.publish(step)
        return out

    @staticmethod
    def _changes(state: PoolState, what: str) -> list[str]:
        out = []
        if state.joined:
            out.append(f"{state.joined} {what}(s) joined: {state.live} live")
        if state.left:
            out.append(f"{state.left} {what}(s) left: {state.live} live")
        return out

    def status(self, step: int) -> LiveStatus:
        return LiveStatus(
            run=self.run_name,
            step=step,
            engines=self.engines.state(),
            reward_workers=self.rewards.state(),
            learner_ranks=self.learner_ranks,
            autoscale=self.autoscale,
            events=list(self.events),
            updated_unix=time.time(),
        )

    def close(self) -> None:
        if self.inbox is not None:
            self.inbox.close()

    def publish(self, step: int) -> LiveStatus:
        """Report the live status (to `groupflow status` and the live series); returns it.
        Between steps, and while a step waits (the job loop's heartbeat)."""
        status = self.status(step)
        if self.inbox is not None:
            self.inbox.report(status)
        if self.gauges is not None:
            eng, rew = status.engines, status.reward_workers
            self.gauges.set_cluster(eng.live, rew.live, self.learner_ranks)
            self.gauges.set_pending("engines", eng.pending)
            self.gauges.set_pending("reward_workers", rew.pending)
        return status


# ----- from the job's config ------------------------------------------------------------------
def policy_for(cfg) -> AutoscalePolicy | None:
    auto = cfg.rollout.autoscale
    if auto is None:
        return None
    return AutoscalePolicy(auto.min_engines, auto.max_engines, patience=auto.patience)
