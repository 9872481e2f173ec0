"""The control protocol of a running job's scaling: what `groupflow scale` asks and how it is
checked, what a pool reports of its actors, the live status `groupflow status` shows, and the
two faces the loop's Scaler (groupflow/loop/scaling.py) drives: the `Inbox` requests come from
(on Ray: the job's control actor, actors/control.py) and the `ScalablePool`s (the generator
and reward pools, actors/).

The actors implement and send these; the autoscale policy and the Scaler that applies it stay
in the loop (groupflow/loop/scaling.py). Nothing here imports Ray.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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

    engines_scalable: bool  # False where the weight transport's members are fixed
    engine_demand: dict[str, float]  # Ray resources of one engine, e.g. {"CPU": 0.5}
    reward_demand: dict[str, float]
    autoscale: tuple[int, int] | None = None  # (min_engines, max_engines) when on
    transport: str = ""  # rollout.weight_transport, named where it fixes the engines


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
                f"--engines: this job uses rollout.weight_transport={limits.transport}, whose "
                "members are fixed once it opens; only --reward-workers can change"
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


# ----- the faces the Scaler drives -----------------------------------------------------------
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
