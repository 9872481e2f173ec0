"""Scaling rollout while a job runs: requests, their checks, the autoscale policy, and the
Scaler that applies them to the pools between steps.

Nothing here imports Ray. Requests arrive through an `Inbox` (on Ray: the job's named control
actor, groupflow/actors/control.py, which `groupflow scale` calls); the pools start and retire
actors themselves (groupflow.peers.Generation/Scoring `scale_to` and `settle`), without
blocking: an actor that has no room on the cluster stays a pending resource request, which
the Ray autoscaler sees, and joins when it is placed and started.

The job loop calls `Scaler.between_steps(record)` once per step, after the step's record is
complete and before it is written: the pools only change between steps, never during a
weight sync (the engines list is shared with the weight transport).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

# One fixed Ray namespace for groupflow's named actors, so that `groupflow scale` (another
# driver, in its own namespace) finds a job's control actor by name.
CONTROL_NAMESPACE = "groupflow"


def control_actor_name(run_name: str) -> str:
    return f"control:{run_name}"


class ScaleError(ValueError):
    """A refused request, phrased as one line."""


@dataclass(frozen=True)
class ScaleRequest:
    """Target counts (None: leave that pool as it is)."""

    engines: int | None = None
    reward_workers: int | None = None


@dataclass(frozen=True)
class ScaleLimits:
    """What a request is checked against, fixed when the job starts."""

    engines_scalable: bool  # False with the collective transport: its group takes no members
    engine_demand: dict[str, float]  # Ray resources of one engine, e.g. {"CPU": 0.5}
    reward_demand: dict[str, float]
    autoscale: tuple[int, int] | None = None  # (min_engines, max_engines) when on


def ray_demand(num_cpus: float, num_gpus: float, custom: Mapping[str, float]) -> dict[str, float]:
    """An actor's resources as Ray names them (zero amounts dropped: they fit anywhere)."""
    demand = {"CPU": num_cpus, "GPU": num_gpus, **custom}
    return {k: float(v) for k, v in demand.items() if v > 0}


def _fits(demand: Mapping[str, float], node: Mapping[str, float]) -> bool:
    return all(node.get(k, 0.0) >= v for k, v in demand.items())


def _never_fits(what: str, demand: Mapping[str, float], nodes: Sequence[Mapping[str, float]]):
    """The one-line reason why no node could ever hold one such actor, or None."""
    if not nodes or any(_fits(demand, n) for n in nodes):
        return None
    for key, amount in demand.items():
        largest = max(n.get(key, 0.0) for n in nodes)
        if largest < amount:
            return (
                f"one {what} needs {key}={amount:g} and no node of the cluster has that much "
                f"(the largest has {largest:g})"
            )
    return f"one {what} needs {demand} and no single node has all of it"


def check_request(
    request: ScaleRequest, limits: ScaleLimits, nodes: Sequence[Mapping[str, float]] = ()
) -> None:
    """Raise ScaleError (one line) for a request the job must not act on. `nodes`: each
    live node's total resources; a count is refused only when one actor fits on none of
    them (more actors than fit now is not an error: they wait for room)."""
    if request.engines is None and request.reward_workers is None:
        raise ScaleError("nothing to scale: give --engines and/or --reward-workers")
    for flag, count, least in (
        ("--engines", request.engines, "a job needs at least one engine"),
        ("--reward-workers", request.reward_workers, "a job needs at least one reward worker"),
    ):
        if count is not None and count < 0:
            raise ScaleError(f"{flag}: a count cannot be negative (got {count})")
        if count == 0:
            raise ScaleError(f"{flag}: {least} (got 0)")
    if request.engines is not None:
        if not limits.engines_scalable:
            raise ScaleError(
                "--engines: this job uses rollout.weight_transport=collective, whose process "
                "group cannot take new members; only --reward-workers can change"
            )
        if limits.autoscale is not None:
            low, high = limits.autoscale
            if not low <= request.engines <= high:
                raise ScaleError(
                    f"--engines: {request.engines} is outside rollout.autoscale's bounds "
                    f"[{low}, {high}]"
                )
        if why := _never_fits("engine", limits.engine_demand, nodes):
            raise ScaleError(f"--engines: {why}")
    if request.reward_workers is not None:
        if why := _never_fits("reward worker", limits.reward_demand, nodes):
            raise ScaleError(f"--reward-workers: {why}")


# ----- what the pools report -------------------------------------------------------------------
@dataclass
class PoolState:
    """A pool's actors between steps."""

    live: int  # taking work
    target: int
    starting: int = 0  # placed, not yet up (an engine loads its model: tens of seconds)
    pending: int = 0  # not placed: no room on the cluster (a pending resource request)
    retiring: int = 0  # finishing the work they hold before they go
    joined: int = 0  # became live in this settle
    left: int = 0  # were removed in this settle


@dataclass
class LiveStatus:
    """What `groupflow status RUN` shows, reported by the driver after every step."""

    run: str
    step: int
    engines: PoolState
    reward_workers: PoolState
    learner_ranks: int
    autoscale: str  # "off", "on [1, 4]", or "off (set by groupflow scale)"
    events: list[str] = field(default_factory=list)  # the latest scale events, newest last
    updated_unix: float = 0.0

    def lines(self) -> list[str]:
        def pool(name: str, p: PoolState) -> str:
            extra = [
                f"{n} {what}"
                for n, what in (
                    (p.starting, "starting"),
                    (p.pending, "pending: no room on the cluster"),
                    (p.retiring, "retiring"),
                )
                if n
            ]
            more = f" ({', '.join(extra)})" if extra else ""
            return f"{name}: {p.live} live, target {p.target}{more}"

        return [
            f"run {self.run}: step {self.step}, autoscale {self.autoscale}",
            pool("engines", self.engines),
            pool("reward workers", self.reward_workers),
            f"learner ranks: {self.learner_ranks}",
        ]

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> LiveStatus:
        return cls(
            **{
                **d,
                "engines": PoolState(**d["engines"]),
                "reward_workers": PoolState(**d["reward_workers"]),
            }
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
class Inbox(Protocol):
    """Where scale requests come from and live status goes (on Ray: the control actor)."""

    def poll(self) -> ScaleRequest | None:
        """The latest request not yet taken (non-blocking)."""

    def report(self, status: LiveStatus) -> None:
        """Publish the job's live status (non-blocking)."""

    def close(self) -> None:
        """The job ended: `groupflow scale` finds it no more."""


class ScalablePool(Protocol):
    def scale_to(self, target: int) -> None:
        """Start or retire actors toward `target`; returns at once."""

    def settle(self) -> PoolState:
        """Between steps: admit actors that came up, remove retired ones that are done."""

    def state(self) -> PoolState:
        """The counts as they are (changes nothing)."""


class LiveGauges(Protocol):
    """The exporter's live series (groupflow.prometheus.PrometheusExporter)."""

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
def limits_for(cfg) -> ScaleLimits:
    """The checks a request to this job meets (cfg: groupflow.config.Config)."""
    eng, rew = cfg.rollout.resources, cfg.reward.resources
    auto = cfg.rollout.autoscale
    return ScaleLimits(
        engines_scalable=cfg.rollout.weight_transport == "object_store",
        engine_demand=ray_demand(eng.num_cpus, eng.num_gpus, eng.custom),
        reward_demand=ray_demand(rew.num_cpus, rew.num_gpus, rew.custom),
        autoscale=None if auto is None else (auto.min_engines, auto.max_engines),
    )


def policy_for(cfg) -> AutoscalePolicy | None:
    auto = cfg.rollout.autoscale
    if auto is None:
        return None
    return AutoscalePolicy(auto.min_engines, auto.max_engines, patience=auto.patience)
