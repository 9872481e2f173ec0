"""`groupflow scale`, `groupflow stop` and the live part of `groupflow status`: reach a running
job's control actor (groupflow/actors/control.py) from another process.

Which job a command means, and the address of its cluster, is decided before
(groupflow/run/target.py, groupflow/run/cluster_address.py). A job trained here (`groupflow train`)
writes runs/<run>/cluster.json while it runs: the GCS address of its cluster and its driver's
pid. A local cluster that `ray.init()` started is not recorded where `ray.init(address="auto")`
looks (only `ray start` writes that), so the run directory is the record.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import socket
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from groupflow.core.errors import UserError, first_line
from groupflow.core.scaling_protocol import (
    CONTROL_NAMESPACE,
    LiveStatus,
    PoolState,
    ScaleLimits,
    ScaleRequest,
    check_request,
    control_actor_name,
)
from groupflow.run.cluster_address import (
    ADDRESS_ENV,
    AddressError,
    ClusterAddress,
    is_dashboard_url,
    join_address,
    probe,
    ray_env_hidden,
)

CLUSTER_FILE = "cluster.json"
AUTH_MODE_ENV = "RAY_AUTH_MODE"
POLL_S = 0.5
RETRY_S = 0.5  # between asks of a control actor whose call failed in transit
MAX_RECORD_BYTES = 64 << 10  # a run record is a few hundred bytes


class LiveError(UserError, RuntimeError):
    """Why the command cannot act on the job, as one line."""

    exit_code = 1


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds above 0 (NaN would wait forever)."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(text)
    return value


# ----- joining a cluster ---------------------------------------------------------------------
def join_ray(address: str | None, **init_kwargs) -> None:
    """ray.init at `address`, in any form of the address rule (groupflow/run/cluster_address.py);
    None: a dashboard URL in $RAY_ADDRESS, else what Ray makes of it (a GCS address there, or
    a new local cluster). Fails in seconds with one line naming the address when nothing
    answers there."""
    import ray

    origin = "cluster.address"
    if address is None and is_dashboard_url(os.environ.get(ADDRESS_ENV, "")):
        address, origin = os.environ[ADDRESS_ENV], f"${ADDRESS_ENV}"
    try:
        if address is not None and is_dashboard_url(address):
            address = join_address(ClusterAddress(address, origin))  # probed there
        elif address is not None:
            probe(address)
    except AddressError as err:
        raise LiveError(str(err)) from None
    try:
        with ray_env_hidden() if address is not None else nullcontext():
            ray.init(address=address, **init_kwargs)
    except ConnectionError as err:
        raise LiveError(f"cannot join the Ray cluster at {address}: {first_line(err)}") from None


# ----- the run's record, written by the driver -------------------------------------------------
def write_cluster_file(run_dir: Path, run_name: str, gcs_address: str) -> Path:
    path = run_dir / CLUSTER_FILE
    record = {
        "run": run_name,
        "gcs_address": gcs_address,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        # A local cluster from ray.init() turns on Ray's token auth (Ray >= 2.60) with the
        # token in ~/.ray/auth_token; a process joining it must ask for that mode too. The
        # token itself is never written here.
        "auth_mode": os.environ.get(AUTH_MODE_ENV, "disabled"),
    }
    path.write_text(json.dumps(record))
    return path


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunRecord(BaseModel):
    """runs/<run>/cluster.json, as write_cluster_file writes it."""

    model_config = ConfigDict(strict=True)

    run: str = Field(min_length=1)
    gcs_address: str = Field(min_length=1)
    pid: int = Field(gt=0, lt=1 << 31)
    host: str
    auth_mode: str | None = None


def read_run_record(path: Path) -> RunRecord:
    """The run's record; a LiveError naming the file when it is not one."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_RECORD_BYTES + 1)
        if len(data) > MAX_RECORD_BYTES:
            raise ValueError(f"larger than {MAX_RECORD_BYTES >> 10} KiB")
        return RunRecord.model_validate(json.loads(data.decode("utf-8")))
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(map(str, first["loc"])) or "record"
        raise LiveError(f"{path}: not a run record ({key}: {first['msg']})") from None
    except (OSError, ValueError, RecursionError) as err:  # JSON and UTF-8 errors are ValueErrors
        problem = getattr(err, "strerror", None) or first_line(err)[:200]
        raise LiveError(f"{path}: not a run record ({problem})") from None


@dataclass
class Target:
    run: str  # the run name (the control actor's name)
    ray_address: str  # what ray.init connects to
    job_id: str | None = None
    auth_mode: str | None = None  # the cluster's RAY_AUTH_MODE, when the run recorded it
    host: str | None = None  # where the run's driver is, when the run recorded it
    pid: int | None = None  # the run's driver, when the run recorded it


def _use_token_auth() -> None:
    """Send the token (~/.ray/auth_token or RAY_AUTH_TOKEN) to the cluster, as a process with
    RAY_AUTH_MODE=token does. Ray read its config when it was imported, before this command
    knew the mode, so the setting is applied the way ray.init() applies it to a new local
    cluster (falling back to the variable alone)."""
    os.environ[AUTH_MODE_ENV] = "token"
    try:
        from ray._private.authentication.authentication_token_setup import _enable_token_auth
    except ImportError:
        return
    _enable_token_auth()


def connect(target: Target):
    """Join the job's cluster and return its control actor."""
    import ray

    elsewhere = target.host not in (None, socket.gethostname())
    where = f" (its driver runs on {target.host})" if elsewhere else ""
    if ray.is_initialized():
        # A process already in a cluster would look the actor up there, and report a run on
        # another cluster as not running.
        joined = ray.get_runtime_context().gcs_address
        if target.ray_address not in ("auto", joined):
            raise LiveError(
                f"run {target.run}{where}: its cluster is at {target.ray_address}, and this "
                f"process is already joined to the Ray cluster at {joined}"
            )
    else:
        if target.auth_mode == "token" and AUTH_MODE_ENV not in os.environ:
            _use_token_auth()
        try:
            join_ray(
                target.ray_address,
                namespace=CONTROL_NAMESPACE,
                logging_level=logging.ERROR,
                log_to_driver=False,
            )
        except LiveError as err:
            raise LiveError(f"run {target.run}{where}: {err}") from None
    actor = ControlActor(target.run)
    if actor.handle is None:
        raise LiveError(f"run {target.run} is not running (no control actor on its cluster)")
    return actor


class ControlActor:
    """The job's control actor, reached by its name.

    A call can fail in transit while the actor lives: when this process's push of the call
    to the actor's worker meets a network error (a machine whose cores are all busy), Ray
    waits a second for news of the actor's death, hears none, and fails the call as "The
    actor died unexpectedly before finishing this task." with no death record. Such a failure
    is asked again, within the call's deadline, for as long as the name still has an actor:
    the name goes with the actor's death, so a job that truly ended is told apart."""

    def __init__(self, run: str, get=None, lookup=None, clock=time.monotonic, sleep=time.sleep):
        import ray

        self.run = run
        self._get = get or ray.get
        self._lookup = lookup or _named_control_actor
        self._clock, self._sleep = clock, sleep
        self.handle = self._lookup(run)

    def ask(self, call, timeout_s: float):
        """The result of `call(handle)` (an actor call: `lambda a: a.status.remote()`) within
        `timeout_s` (GetTimeoutError past it); RayActorError once the name has no actor."""
        import ray

        deadline = self._clock() + timeout_s
        while True:
            ref = call(self.handle)
            try:
                return self._get(ref, timeout=max(deadline - self._clock(), 0.0))
            except ray.exceptions.RayActorError:
                handle = self._lookup(self.run)
                if handle is None or self._clock() + RETRY_S >= deadline:
                    raise
                self.handle = handle
                self._sleep(RETRY_S)


def _named_control_actor(run: str):
    import ray

    try:
        return ray.get_actor(control_actor_name(run), namespace=CONTROL_NAMESPACE)
    except ValueError:  # no actor has the name: never started, or it ended with its job
        return None


def live_status(actor: ControlActor, timeout_s: float = 10.0) -> tuple[LiveStatus | None, bool]:
    status, waiting = actor.ask(lambda a: a.status.remote(), timeout_s=timeout_s)
    return (LiveStatus.from_dict(status) if status else None), waiting


# ----- the commands ---------------------------------------------------------------------------
def check_counts(engines: int | None, reward_workers: int | None) -> None:
    """The checks that need no job: a count given, none below one."""
    anything = ScaleLimits(True, {}, {})
    check_request(ScaleRequest(engines, reward_workers), anything)


def _settled(state: PoolState, want: int | None) -> bool:
    if want is None:
        return True
    return state.live == want and not (state.starting or state.pending or state.retiring)


def _waiting_line(status: LiveStatus) -> str | None:
    parts = []
    for name, p in (("engine", status.engines), ("reward worker", status.reward_workers)):
        if p.pending:
            parts.append(f"{p.pending} {name}(s) pending: no room on the cluster")
        if p.starting:
            parts.append(f"{p.starting} {name}(s) starting")
        if p.retiring:
            parts.append(f"{p.retiring} {name}(s) finishing their work")
    return "waiting: " + "; ".join(parts) + " (the job trains on meanwhile)" if parts else None


def scale(
    actor,
    engines: int | None,
    reward_workers: int | None,
    wait: bool,
    timeout_s: float,
    out=print,
) -> int:
    """Send the request; with `wait`, follow it until the pools have the counts asked for.
    0 when done (or sent, without `wait`), 1 when refused or not done in time."""
    import ray

    before, _ = live_status(actor)
    refusal = actor.ask(lambda a: a.request.remote(engines, reward_workers), timeout_s=30)
    if refusal is not None:
        raise LiveError(refusal)
    asked = ", ".join(
        f"{name} -> {n}"
        for name, n in (("engines", engines), ("reward workers", reward_workers))
        if n is not None
    )
    if not wait:
        out(f"requested: {asked} (the job applies it after its current step)")
        return 0
    deadline = time.monotonic() + timeout_s
    said = None
    while True:
        try:
            status, request_waiting = live_status(actor)
        except ray.exceptions.RayActorError:
            raise LiveError("the job ended before the change was complete") from None
        if status is not None and not request_waiting:
            if _settled(status.engines, engines) and _settled(
                status.reward_workers, reward_workers
            ):
                for name, n, was in (
                    ("engines", engines, before.engines if before else None),
                    ("reward workers", reward_workers, before.reward_workers if before else None),
                ):
                    if n is not None:
                        old = was.live if was is not None else "?"
                        out(f"{name}: {old} -> {n}" if old != n else f"{name}: {n} (unchanged)")
                return 0
            line = _waiting_line(status)
            if line is not None and line != said:
                out(line)
                said = line
        if time.monotonic() > deadline:
            out(f"still waiting after {timeout_s:g}s; the request stands: {asked}")
            return 1
        time.sleep(POLL_S)


def print_live(actor, out=print) -> None:
    status, waiting = live_status(actor)
    if status is None:
        out("live: the job has not finished its first step yet")
        return
    for line in status.lines():
        out(line)
    if waiting:
        out("a scale request waits for the end of the current step")
    age = time.time() - status.updated_unix
    if age > 60:
        out(f"(reported {age:.0f}s ago: a step is taking long)")


def stop(actor, now: bool, timeout_s: float, out=print) -> bool:
    """Ask the job to stop (groupflow/loop/stopping.py) and wait for it to end, printing the line
    that says what it wrote. False when it has not ended within `timeout_s`."""
    import ray

    try:
        actor.ask(lambda a: a.stop.remote(now), timeout_s=30)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
        raise LiveError(f"the job did not take the stop request ({first_line(err)})") from None
    if now:
        out("stop --now requested: the job ends at once, writing nothing more")
    else:
        out(
            "stop requested: the job finishes its step in flight (abandoned when its samples "
            "are late: trainer.stop_timeout_s), then writes its checkpoint, model, plots and "
            "summary"
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = actor.ask(lambda a: a.end_line.remote(), timeout_s=10)
        except ray.exceptions.RayActorError:
            out("the job has ended")
            return True
        except ray.exceptions.GetTimeoutError:
            continue
        if line is not None:
            out(line)
            return True
        time.sleep(POLL_S)
    return False


def signal_driver(target: Target) -> str:
    """A local run's driver sent SIGTERM (after a stop asked through the control actor, it
    aborts at once; groupflow/loop/stopping.py); what was done."""
    if target.pid is None or target.host != socket.gethostname():
        raise LiveError(
            f"run {target.run}: its driver runs on {target.host or 'another machine'}; "
            "stop it there"
        )
    try:
        os.kill(target.pid, signal.SIGTERM)
    except ProcessLookupError:
        return f"run {target.run} has ended"
    return f"sent SIGTERM to the driver of run {target.run} (pid {target.pid})"
