"""A pool's actors by slot, and how the pool grows and shrinks between steps.

`ActorSlots` is the bookkeeping that the engine pool and the reward pool share: actors asked
for and not yet admitted (`StartingActors`), slots retiring (given no new work, removed once
they hold none) and the target count. What an actor holds is the pool's business; it tells
`settle` which slots are busy and keeps its own per-slot figures in step with the slots.

`actor_class.remote()` returns at once. Ray places the actor when a node has room for its
resources; until then it is a pending resource request, which the Ray autoscaler (and
KubeRay's) reads as demand for a node. The pool polls these actors between steps
(`take_ready`, never blocking) and admits those whose constructor has finished.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import ray
from ray.exceptions import RayError

from groupflow.scaling import PoolState
from groupflow.start_errors import StartError, start_failure

log = logging.getLogger(__name__)


def wait_started(what: str, refs: Sequence[ray.ObjectRef]) -> list:
    """The values of `refs`, calls that end an actor's start (its constructor, a rank's
    init); an actor that failed fails the job with one line: its own error and its node,
    not Ray's "the actor died" (groupflow/start_errors.py)."""
    try:
        return ray.get(list(refs))
    except RayError as err:
        raise StartError(start_failure(what, str(err))) from None


@dataclass
class _Starting:
    actor: ray.actor.ActorHandle
    ready: ray.ObjectRef  # resolves when the constructor has returned


class StartingActors:
    def __init__(
        self,
        what: str,
        ready: Callable[[ray.actor.ActorHandle], ray.ObjectRef] = lambda a: (
            a.__ray_ready__.remote()
        ),
    ):
        self.what = what
        self.ready = ready  # the call whose end makes an actor ready (e.g. a warm-up)
        self._starting: list[_Starting] = []

    def __len__(self) -> int:
        return len(self._starting)

    def add(self, actor: ray.actor.ActorHandle) -> None:
        self._starting.append(_Starting(actor, self.ready(actor)))

    def take_ready(self) -> tuple[list[ray.actor.ActorHandle], int]:
        """The actors that are up now (in the order asked for), and how many failed to start
        (dropped: their constructor raised or their process died)."""
        if not self._starting:
            return [], 0
        refs = [s.ready for s in self._starting]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        done_set = set(done)
        ready, failed = [], 0
        for s in [s for s in self._starting if s.ready in done_set]:
            self._starting.remove(s)
            try:
                ray.get(s.ready)
            except RayError as err:  # its constructor or warm-up raised, or its process died
                log.warning("%s", start_failure(f"new {self.what}", str(err)))
                ray.kill(s.actor, no_restart=True)
                failed += 1
                continue
            ready.append(s.actor)
        return ready, failed

    def cancel(self, count: int) -> int:
        """Give up the newest `count` actors not yet up (a pending one frees its resource
        request); how many were cancelled."""
        cancelled = 0
        while self._starting and cancelled < count:
            ray.kill(self._starting.pop().actor, no_restart=True)
            cancelled += 1
        return cancelled

    def placed(self) -> int:
        """How many have a node (and are loading); the others wait for room. Asked of Ray's
        state API, which is served by the dashboard: without one, all count as placed."""
        if not self._starting:
            return 0
        try:
            from ray.util.state import get_actor

            # This cluster's address: with none, the state API refuses when a machine runs
            # more than one cluster.
            address = ray.get_runtime_context().gcs_address
            states = [
                get_actor(s.actor._actor_id.hex(), address=address, timeout=2)
                for s in self._starting
            ]
        except Exception:  # no dashboard, or it is busy: the split is only informative
            return len(self._starting)
        # An actor stays PENDING_CREATION while its constructor runs (an engine loading its
        # model); it has a worker process (a pid) once a node took it.
        return sum(1 for st in states if st is not None and (st.pid or st.state == "ALIVE"))

    def shutdown(self) -> None:
        self.cancel(len(self._starting))


class ActorSlots:
    """A pool's live actors (`actors`, a list the pool indexes by slot), the ones starting, and
    the slots retiring."""

    def __init__(self, actors: list, starting: StartingActors):
        self.actors = actors  # in place: others (the weight transport) may hold this list
        self.starting = starting
        self.retiring: set[int] = set()  # slots given no new work, removed once drained
        self.target = len(actors)

    def live(self) -> int:
        return len(self.actors) - len(self.retiring)

    def scale_to(self, target: int, start: Callable[[], ray.actor.ActorHandle]) -> list:
        """Aim for `target` live actors; returns the actors started for it. Retired slots come
        back first (an engine there holds the weights), then new actors start; fewer cancels
        actors not yet up, then retires the highest live slots."""
        self.target = target
        while self.retiring and self.live() < target:
            self.retiring.remove(min(self.retiring))
        started = [start() for _ in range(target - self.live() - len(self.starting))]
        for actor in started:
            self.starting.add(actor)
        excess = self.live() + len(self.starting) - target
        excess -= self.starting.cancel(max(0, excess))
        active = [slot for slot in range(len(self.actors)) if slot not in self.retiring]
        self.retiring.update(sorted(active, reverse=True)[: max(0, excess)])
        return started

    def admit(self) -> list:
        """Append the actors that are up to `actors` and return them; a failed start is not
        retried: the target drops to what exists."""
        ready, failed = self.starting.take_ready()
        self.target -= failed
        self.actors.extend(ready)
        return ready

    def drained(self, busy: set[int]) -> list[int]:
        """Retiring slots that hold no work, highest first (so removing them in this order
        leaves the others' numbers valid)."""
        return sorted(self.retiring - busy, reverse=True)

    def remove(self, slot: int):
        """Take the actor out of its slot and renumber the retiring slots above it; returns
        the actor (the pool ends it)."""
        self.retiring = {s - 1 if s > slot else s for s in self.retiring if s != slot}
        return self.actors.pop(slot)

    def state(self, joined: int = 0, left: int = 0) -> PoolState:
        placed = self.starting.placed()
        return PoolState(
            live=self.live(),
            target=self.target,
            starting=placed,
            pending=len(self.starting) - placed,
            retiring=len(self.retiring),
            joined=joined,
            left=left,
        )
