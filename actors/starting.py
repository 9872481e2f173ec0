"""A pool's actors by slot, and how the pool grows and shrinks between steps.

`ActorSlots` is the bookkeeping that the engine pool and the reward pool share: actors asked
for and not yet admitted (`StartingActors`), slots retiring (given no new work, removed once
they hold none) and the target count. What an actor holds is the pool's business; it tells
`settle` which slots are busy and keeps its own per-slot figures in step with the slots.

`actor_class.remote()` returns at once. Ray places the actor when a node has room for its
resources; until then it is a pending resource request, which the Ray autoscaler (and
KubeRay's) reads as demand for a node. The pool polls these actors between steps
(`take_ready`, never blocking) and admits those whose constructor has finished.

An actor that dies (killed, out of memory, its node lost) leaves its slot vacant: the slot
takes no work, and `Replacements` starts a new actor for it, which fills the slot the moment
it is up, mid-step included (the job loop waits on its start with everything else), so a pool
goes on with the actors it still has and one whose every actor was lost goes on as soon as one
is back. A replacement that waits for room on the cluster is said once, with what it asks and
what the cluster has, and counts as pending, never as live.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import ray
from ray.exceptions import RayError

from groupflow.actors.placement import has_node, live_nodes
from groupflow.core.peers import Futures, Handle, PeerDied
from groupflow.core.placement import NOTE_AFTER_S, POLL_S, describe_cluster, describe_demand
from groupflow.core.scaling_protocol import PoolState
from groupflow.core.start_errors import StartError, start_failure
from groupflow.observe.progress import PhaseProgress

log = logging.getLogger(__name__)


def wait_started(
    what: str, refs: Sequence[ray.ObjectRef], progress: PhaseProgress | None = None
) -> list:
    """The values of `refs`, calls that end an actor's start (its constructor, a rank's
    init); an actor that failed fails the job with one line: its own error and its node,
    not Ray's "the actor died" (groupflow/core/start_errors.py). `progress` (the job's start,
    groupflow/observe/progress.py) is told how many are up."""
    pending = list(refs)
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
            ray.get(done)  # a failed start fails the wait at once
            if progress is not None:
                progress.update(note=f"{what}s {len(refs) - len(pending)}/{len(refs)} up")
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
        """How many have a node (and are loading); the others wait for room. Asked of the
        GCS, one actor at a time (no dashboard needed, no state-API timeouts per actor)."""
        return sum(has_node(s.actor) for s in self._starting)

    def shutdown(self) -> None:
        self.cancel(len(self._starting))


@dataclass
class _Replacement:
    slot: int
    start: Callable[[], object]  # a new actor for the slot
    asked_at: float
    actor: object = None
    ready: Handle | None = None  # resolves when the actor is up; None: to be asked again
    again_at: float = 0.0  # when, after it died starting
    noted: bool = False  # its wait for room on the cluster was said


# A replacement that died before it was up, not of an error of its own (its node lost too, or
# the cluster still counting a lost node's room as free), is asked for again after this long.
ASK_AGAIN_S = 5.0


class Replacements:
    """Actors started in place of dead ones, each for its slot (see the module's docstring).
    `futures` is the job's (the replacements' starts are waited on in the job loop's one
    wait); `demand` is one actor's resources as Ray names them, for what is said of a wait."""

    def __init__(
        self,
        what: str,
        ready: Callable[[object], Handle],
        futures: Futures,
        demand: Mapping[str, float],
        *,
        placed: Callable[[object], bool] = has_node,
        cluster: Callable[[], tuple[list, dict]] = live_nodes,
        end: Callable[[object], None] = lambda a: ray.kill(a, no_restart=True),
        clock: Callable[[], float] = time.monotonic,
        note: Callable[[str], None] = log.warning,
    ):
        self.what, self.ready, self.futures, self.demand = what, ready, futures, dict(demand)
        self.placed, self.cluster, self.end = placed, cluster, end
        self.clock, self.note = clock, note
        self._waiting: list[_Replacement] = []

    def __len__(self) -> int:
        return len(self._waiting)

    def ask(self, slot: int, start: Callable[[], object]) -> None:
        """Start a replacement for `slot` (`start` makes the actor)."""
        r = _Replacement(slot, start, self.clock())
        self._launch(r)
        self._waiting.append(r)

    def _launch(self, r: _Replacement) -> None:
        r.actor = r.start()
        r.ready = self.ready(r.actor)

    def vacant(self) -> set[int]:
        return {r.slot for r in self._waiting}

    def handles(self) -> list[Handle]:
        return [r.ready for r in self._waiting if r.ready is not None]

    def take(self, ready: Sequence[Handle]) -> tuple[list[tuple[int, object]], list[tuple]]:
        """Of the replacements whose start ended among `ready`: those up, as (slot, actor),
        and those that failed of an error of their own, as (slot, one line: that error and
        the node). One that died starting otherwise is asked for again ASK_AGAIN_S later."""
        ready, now = set(ready), self.clock()
        up, failed = [], []
        for r in [r for r in self._waiting if r.ready is not None and r.ready in ready]:
            try:
                self.futures.get([r.ready])
            except Exception as err:  # its constructor or warm-up raised, or it died
                self.end(r.actor)
                line = start_failure(f"{self.what} replacement", _text(err))
                if _of_its_own(err):
                    self._waiting.remove(r)
                    failed.append((r.slot, line))
                else:
                    r.ready, r.again_at = None, now + ASK_AGAIN_S
                    log.warning(
                        "%s; not an error of its own (its node lost?): asking again in %.0fs",
                        line,
                        ASK_AGAIN_S,
                    )
                continue
            self._waiting.remove(r)
            log.info(
                "%s %d's replacement is up, %.0fs after it was asked for",
                self.what,
                r.slot,
                now - r.asked_at,
            )
            up.append((r.slot, r.actor))
        for r in self._waiting:
            if r.ready is None and r.again_at <= now:
                self._launch(r)
        return up, failed

    def census(self) -> tuple[int, int]:
        """(placed, pending) replacements; one that has waited NOTE_AFTER_S for room on the
        cluster is said once, with what it asks and what the cluster has."""
        placed = [r.ready is not None and self.placed(r.actor) for r in self._waiting]
        now = self.clock()
        for r, has in zip(self._waiting, placed, strict=True):
            if not has and not r.noted and now - r.asked_at >= NOTE_AFTER_S:
                r.noted = True
                nodes, free = self.cluster()
                self.note(
                    f"{self.what} {r.slot}'s replacement has waited {now - r.asked_at:.0f}s for "
                    f"room on the cluster: it asks {describe_demand(self.demand)}; the cluster "
                    f"has {describe_cluster(nodes, free, self.demand)}"
                )
        return sum(placed), len(placed) - sum(placed)

    def renumber(self, removed: int) -> None:
        """The slot `removed` left the pool: the slots above it move down one."""
        for r in self._waiting:
            if r.slot > removed:
                r.slot -= 1

    def shutdown(self) -> None:
        for r in self._waiting:
            self.end(r.actor)
        self._waiting = []


def _text(err: BaseException) -> str:
    """The whole of Ray's report of a failed start (PeerDied keeps it as its cause)."""
    return str(err.__cause__ or err)


def _of_its_own(err: BaseException) -> bool:
    """A start that failed of the actor's own error: its constructor raised (Ray's
    actor_init_failed) or its ready call did; not a death from outside (its node lost)."""
    return not isinstance(err, PeerDied) or bool(getattr(err.__cause__, "actor_init_failed", 0))


class ActorSlots:
    """A pool's actors (`actors`, a list the pool indexes by slot), the ones starting, the
    slots retiring, and the slots vacant while their replacement starts."""

    def __init__(
        self, actors: list, starting: StartingActors, replacements: Replacements | None = None
    ):
        self.actors = actors  # in place: others (the weight transport) may hold this list
        self.starting = starting
        self.replacements = replacements
        self.retiring: set[int] = set()  # slots given no new work, removed once drained
        self.target = len(actors)

    def vacant(self) -> set[int]:
        return set() if self.replacements is None else self.replacements.vacant()

    def idle(self) -> set[int]:
        """Slots given no work: retiring or vacant."""
        return self.retiring | self.vacant()

    def live(self) -> int:
        return len(self.actors) - len(self.idle())

    def scale_to(self, target: int, start: Callable[[], ray.actor.ActorHandle]) -> list:
        """Aim for `target` live actors; returns the actors started for it. Retired slots come
        back first (an engine there holds the weights), then new actors start; fewer cancels
        actors not yet up, then retires the highest live slots."""
        self.target = target
        while self.retiring and self.live() < target:
            self.retiring.remove(min(self.retiring))
        # A replacement coming counts toward a larger target; toward a smaller one it does
        # not (it may never come): it retires as it fills its slot (`fill`).
        coming = len(self.starting) + len(self.replacements or ())
        started = [start() for _ in range(target - self.live() - coming)]
        for actor in started:
            self.starting.add(actor)
        excess = self.live() + len(self.starting) - target
        excess -= self.starting.cancel(max(0, excess))
        active = [slot for slot in range(len(self.actors)) if slot not in self.idle()]
        self.retiring.update(sorted(active, reverse=True)[: max(0, excess)])
        return started

    def fill(self, slot: int, actor) -> None:
        """A replacement is up: it takes its vacant slot, retiring at once where the pool was
        scaled down meanwhile."""
        self.actors[slot] = actor
        if self.live() > self.target:
            self.retiring.add(slot)

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
        if self.replacements is not None:
            self.replacements.renumber(slot)
        return self.actors.pop(slot)

    def state(self, joined: int = 0, left: int = 0) -> PoolState:
        placed = self.starting.placed()
        replaced, unplaced = (0, 0) if self.replacements is None else self.replacements.census()
        return PoolState(
            live=self.live(),
            target=self.target,
            starting=placed + replaced,
            pending=len(self.starting) - placed + unplaced,
            retiring=len(self.retiring),
            joined=joined,
            left=left,
        )
