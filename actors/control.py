"""The job's control actor: where `groupflow scale`, `groupflow status` and `groupflow stop`
reach a running job.

A named actor (`control:<run name>` in the `groupflow` namespace), created by the driver and
owned by it, so it ends with the job. It never calls the driver: `groupflow scale` leaves a
checked request here, and the driver takes it between steps (`ActorInbox.poll`) and reports
its live counts back (`ActorInbox.report`). Neither side ever waits on the other's work, so a
scale request never blocks training, and a busy job never blocks the command. A stop is left
the same way (`stop`); the driver looks for it between steps and while a step waits
(`ActorInbox.stop_asked`, groupflow/loop/stopping.py), and leaves the line saying what it wrote
(`ended`) before it ends.
"""

from __future__ import annotations

import logging
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from groupflow.actors.transport_registry import transport_class
from groupflow.config import Config
from groupflow.core.scaling_protocol import (
    CONTROL_NAMESPACE,
    LiveStatus,
    ScaleError,
    ScaleLimits,
    ScaleRequest,
    check_request,
    control_actor_name,
    ray_demand,
)

log = logging.getLogger(__name__)

# Seconds the driver waits for the control actor's answer between steps: it is a dict lookup
# on an idle actor, so only a lost node makes it slow, and then the job goes on without it.
_POLL_TIMEOUT_S = 5.0
# How long a stopped job waits for `groupflow stop` to read its last line (the command asks
# every live.POLL_S), and how often it looks.
_READ_WAIT_S = 10.0
_READ_POLL_S = 0.2


def _node_totals() -> list[dict[str, float]]:
    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


class JobControl:
    def __init__(self, limits: ScaleLimits):
        self.limits = limits
        self._request: ScaleRequest | None = None
        self._status: dict | None = None
        self._stop: str | None = None  # None, "stop", or "now" (groupflow/loop/stopping.py)
        self._end_line: str | None = None
        self._end_line_read = False

    def request(self, engines: int | None, reward_workers: int | None) -> str | None:
        """Check and keep a request (a newer one replaces one not yet taken); the reason
        it was refused, or None."""
        request = ScaleRequest(engines, reward_workers)
        try:
            check_request(request, self.limits, _node_totals())
        except ScaleError as err:
            return str(err)
        if self._request is not None:  # merge: a count not given keeps the earlier one
            request = ScaleRequest(
                engines if engines is not None else self._request.engines,
                reward_workers if reward_workers is not None else self._request.reward_workers,
            )
        self._request = request
        return None

    def take(self) -> ScaleRequest | None:
        request, self._request = self._request, None
        return request

    def report(self, status: dict) -> None:
        self._status = status

    def status(self) -> tuple[dict | None, bool]:
        """The job's latest live status, and whether a request still waits to be taken."""
        return self._status, self._request is not None

    def stop(self, now: bool) -> None:
        """`groupflow stop`: end after the step in flight, or (`now`) at once."""
        self._stop = "now" if now else (self._stop or "stop")

    def stop_asked(self) -> str | None:
        return self._stop

    def end(self, line: str) -> None:
        self._end_line = line

    def end_line(self) -> str | None:
        """What the stopped job wrote (its driver's last line), once it has."""
        self._end_line_read = self._end_line is not None
        return self._end_line

    def end_line_read(self) -> bool:
        return self._end_line_read


def limits_for(cfg: Config) -> ScaleLimits:
    """The checks a request to this job meets."""
    eng, rew = cfg.rollout.resources, cfg.reward.resources
    auto = cfg.rollout.autoscale
    return ScaleLimits(
        engines_scalable=transport_class(cfg.rollout.weight_transport).elastic,
        engine_demand=ray_demand(eng.num_cpus, eng.num_gpus, eng.custom),
        reward_demand=ray_demand(rew.num_cpus, rew.num_gpus, rew.custom),
        autoscale=None if auto is None else (auto.min_engines, auto.max_engines),
        transport=cfg.rollout.weight_transport,
    )


def start_control(run_name: str, limits: ScaleLimits):
    """The job's control actor; None when another running job holds the name (the job runs
    on, without `groupflow scale`)."""
    try:
        return (
            ray.remote(JobControl)
            .options(
                name=control_actor_name(run_name),
                namespace=CONTROL_NAMESPACE,
                num_cpus=0,  # must start even on a full cluster
                # Beside the driver: on another node it could be lost with that node, and
                # `scale` and `status` with it, while the job goes on.
                scheduling_strategy=NodeAffinitySchedulingStrategy(
                    ray.get_runtime_context().get_node_id(), soft=False
                ),
            )
            .remote(limits)
        )
    except ValueError as err:  # the name is taken
        log.warning("no `groupflow scale` for this job: %s", str(err).splitlines()[0])
        return None


class ActorInbox:
    """The driver's side of the control actor (groupflow.core.scaling_protocol.Inbox)."""

    def __init__(self, actor):
        self.actor = actor

    def poll(self) -> ScaleRequest | None:
        try:
            return ray.get(self.actor.take.remote(), timeout=_POLL_TIMEOUT_S)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as err:
            log.warning("control actor did not answer (%s); no scale request taken", err)
            return None

    def report(self, status: LiveStatus) -> None:
        self.actor.report.remote(status.as_dict())  # not awaited: a status is best effort

    def stop_asked(self) -> str | None:
        """Whether `groupflow stop` asked the job to stop: None, "stop" or "now"."""
        try:
            return ray.get(self.actor.stop_asked.remote(), timeout=_POLL_TIMEOUT_S)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as err:
            log.warning("control actor did not answer (%s); no stop request seen", err)
            return None

    def ended(self, line: str, reader: bool) -> None:
        """Leave the line saying how the job ended for `groupflow stop` to print and, when
        that command asked for the stop (`reader`), wait for it to read the line, up to
        _READ_WAIT_S: the actor ends with the job right after."""
        deadline = time.monotonic() + _READ_WAIT_S
        try:
            ray.get(self.actor.end.remote(line), timeout=_POLL_TIMEOUT_S)
            while reader and time.monotonic() < deadline:
                if ray.get(self.actor.end_line_read.remote(), timeout=_POLL_TIMEOUT_S):
                    return
                time.sleep(_READ_POLL_S)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
            pass  # `groupflow stop` then says the job ended, without the line

    def close(self) -> None:
        ray.kill(self.actor)
