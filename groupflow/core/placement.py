"""Placement you can see: before training, every actor kind is placed within a deadline.

Ray queues an actor that no node has room for as a pending resource request and says nothing:
a reward pool that is never placed makes every batch time out, and the job would train on
zero rewards. So the job waits at most `cluster.placement_timeout_s` for every actor it starts
with to have a node, then fails with one line naming the pool, what one actor asks for and
what the cluster has (as `ray status` would say it). The deadline, not an instant check,
because an autoscaler may add the node that fits. Pure: the Ray side (actors/placement.py)
gives the counts and the cluster's resources.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from groupflow.core.errors import UserError

log = logging.getLogger(__name__)

# A pool still waiting after this long is said once (it may be an autoscaler adding a node).
NOTE_AFTER_S = 10.0
POLL_S = 0.25


class PlacementError(UserError):
    """An actor kind the cluster did not place within the startup deadline."""

    exit_code = 1  # the cluster's problem, or the resources asked of it


@dataclass(frozen=True)
class PoolAsk:
    """What a pool asks of the cluster at start."""

    pool: str  # "engines", "reward workers", "learner ranks"
    key: str  # the config key that sets it, e.g. "reward.resources"
    demand: Mapping[str, float]  # one actor's resources, as Ray names them
    count: int


def _amount(value: float) -> str:
    return f"{value:g}"


def describe_demand(demand: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {_amount(v)}" for k, v in demand.items()) + "}"


def describe_cluster(
    nodes: Sequence[Mapping[str, float]],
    available: Mapping[str, float],
    demand: Mapping[str, float],
) -> str:
    """What the live nodes have of CPU, GPU and each resource `demand` names: free of total,
    summed, and the most any one node has (an actor must fit on one node)."""
    names = ["CPU", "GPU", *(k for k in demand if k not in ("CPU", "GPU"))]
    parts = []
    for name in names:
        per_node = [n.get(name, 0.0) for n in nodes]
        total = sum(per_node)
        if total == 0:
            parts.append(f"no {name}")
            continue
        parts.append(
            f"{name} {_amount(available.get(name, 0.0))} free of {_amount(total)} "
            f"(at most {_amount(max(per_node))} on one node)"
        )
    count = f"{len(nodes)} live node{'s' if len(nodes) != 1 else ''}"
    return f"{count}: " + ", ".join(parts)


def unplaced_line(
    ask: PoolAsk,
    placed: int,
    timeout_s: float,
    nodes: Sequence[Mapping[str, float]],
    available: Mapping[str, float],
) -> str:
    return (
        f"{ask.pool}: {ask.count - placed} of {ask.count} not placed on the cluster within "
        f"cluster.placement_timeout_s={_amount(timeout_s)}; each asks "
        f"{describe_demand(ask.demand)} ({ask.key}); the cluster has "
        f"{describe_cluster(nodes, available, ask.demand)}"
    )


@dataclass
class Placement:
    """Waits for the pools' actors to be placed (`wait`)."""

    pools: Sequence[tuple[PoolAsk, Callable[[], int]]]  # each ask, and how many are placed now
    cluster: Callable[[], tuple[list[dict[str, float]], dict[str, float]]]  # nodes, free
    timeout_s: float
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    note: Callable[[str], None] = log.warning

    def wait(self) -> None:
        """Return once every pool is placed; raise PlacementError, naming the first pool that
        is not, at the deadline."""
        started = self.clock()
        noted = False
        while True:
            unplaced = [(ask, n) for ask, placed in self.pools if (n := placed()) < ask.count]
            if not unplaced:
                return
            waited = self.clock() - started
            if waited >= self.timeout_s:
                nodes, available = self.cluster()
                raise PlacementError(unplaced_line(*unplaced[0], self.timeout_s, nodes, available))
            if not noted and waited >= NOTE_AFTER_S:
                noted = True
                for ask, n in unplaced:
                    self.note(
                        f"waiting for {ask.count - n} of {ask.count} {ask.pool} to be placed "
                        f"(each asks {describe_demand(ask.demand)}, {ask.key}); the job fails "
                        f"if they are not within cluster.placement_timeout_s="
                        f"{_amount(self.timeout_s)}"
                    )
            self.sleep(min(POLL_S, self.timeout_s - waited))
