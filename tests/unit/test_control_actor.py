"""`groupflow status | scale | stop` reading a job's control actor (groupflow/run/live.py
`ControlActor`): a call that fails in transit while the actor lives is asked again; one whose
actor is gone is not. Against stand-ins for the actor and for ray.get, on a virtual clock."""

from __future__ import annotations

import pytest
from ray.exceptions import ActorDiedError, GetTimeoutError

from groupflow.core.scaling_protocol import LiveStatus, PoolState
from groupflow.run import live


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class Method:
    def __init__(self, name: str):
        self.name = name

    def remote(self, *args):
        return (self.name, args)


class Handle:
    status = Method("status")
    request = Method("request")


def _status() -> dict:
    pools = dict(
        engines=PoolState(live=1, target=1),
        reward_workers=PoolState(live=3, target=3),
    )
    status = LiveStatus("quickstart", 4, learner_ranks=2, autoscale="off", **pools)
    return status.as_dict()


def _actor(answers: list, alive: list[bool], clock: Clock) -> live.ControlActor:
    """A control actor whose calls get `answers` in turn (an exception is raised) and whose
    name has an actor while `alive` says so (one entry per lookup, the first at connect)."""

    def get(call, timeout):
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def lookup(run):
        return Handle() if alive.pop(0) else None

    return live.ControlActor("quickstart", get, lookup, clock, clock.sleep)


def test_a_call_lost_in_transit_while_the_actor_lives_is_asked_again(capsys):
    """The flaky status: Ray fails a call whose push met a network error as "The actor died
    unexpectedly" when no death record follows; the name still has its actor, so it is asked
    again and the status is printed."""
    clock = Clock()
    actor = _actor([ActorDiedError(), (_status(), False)], [True, True], clock)
    live.print_live(actor)
    out = capsys.readouterr().out
    assert "reward workers: 3 live, target 3" in out and "unavailable" not in out
    assert clock.now == live.RETRY_S


def test_a_call_to_an_actor_that_ended_fails_at_once():
    clock = Clock()
    actor = _actor([ActorDiedError()], [True, False], clock)
    with pytest.raises(ActorDiedError):
        live.live_status(actor)
    assert clock.now == 0.0


def test_asking_again_stays_within_the_call_deadline():
    clock = Clock()
    actor = _actor([ActorDiedError()] * 100, [True] * 101, clock)
    with pytest.raises(ActorDiedError):
        actor.ask(lambda a: a.status.remote(), timeout_s=2.0)
    assert clock.now <= 2.0


def test_a_slow_answer_is_a_timeout_not_a_retry():
    clock = Clock()
    actor = _actor([GetTimeoutError()], [True], clock)
    with pytest.raises(GetTimeoutError):
        actor.ask(lambda a: a.status.remote(), timeout_s=2.0)


def test_scale_goes_on_through_a_call_lost_in_transit():
    clock = Clock()
    before = LiveStatus.from_dict(_status())
    before.reward_workers = PoolState(live=2, target=2)
    answers = [(before.as_dict(), False), None, ActorDiedError(), (_status(), False)]
    actor = _actor(answers, [True, True], clock)
    said = []
    assert live.scale(actor, None, 3, wait=True, timeout_s=60, out=said.append) == 0
    assert said == ["reward workers: 2 -> 3"]
