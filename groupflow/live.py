"""`groupflow scale`, `groupflow stop` and the live part of `groupflow status`: reach a running
job's control actor (groupflow/actors/control.py) from another process.

Finding the job's Ray cluster:
- A job trained here (`groupflow train`) writes runs/<run>/cluster.json while it runs: the
  GCS address of its cluster and its driver's pid. A local cluster that `ray.init()` started
  is not recorded where `ray.init(address="auto")` looks (only `ray start` writes that), so
  the run directory is the record.
- A submitted job (`groupflow submit`) is found through the Ray Jobs API at --address, by job
  id or by run name (the submission's `groupflow_run` metadata). This process then joins the
  cluster as a Ray driver: with `ray.init(address="auto")` when the dashboard is on this
  machine (a `ray start` head records its address), else through the Ray Client port of the
  head (ray://HOST:10001, which KubeRay's head service exposes); --ray-address (or
  $GROUPFLOW_RAY_ADDRESS) overrides, e.g. with the head's GCS address HOST:6379 when this
  machine runs more than one Ray cluster.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from groupflow.errors import UserError, first_line
from groupflow.scaling import (
    CONTROL_NAMESPACE,
    LiveStatus,
    PoolState,
    ScaleLimits,
    ScaleRequest,
    check_request,
    control_actor_name,
)

CLUSTER_FILE = "cluster.json"
AUTH_MODE_ENV = "RAY_AUTH_MODE"
# The default of --ray-address. (RAY_ADDRESS cannot serve: the Jobs commands read it as the
# dashboard's URL, as Ray's own `ray job` does.)
RAY_ADDRESS_ENV = "GROUPFLOW_RAY_ADDRESS"
RAY_CLIENT_PORT = 10001  # `ray start --head`'s default Ray Client port
POLL_S = 0.5
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}
MAX_RECORD_BYTES = 64 << 10  # a run record is a few hundred bytes
CONNECT_TIMEOUT_S = 5.0  # for a Ray address to accept a connection before ray.init waits on it


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
def _probe(address: str) -> None:
    """Refuse, within seconds, an address where no Ray cluster answers: ray.init would retry
    it for about half a minute and end in a traceback."""
    parsed = urlparse(address if "://" in address else f"gcs://{address}")
    try:
        host, port = parsed.hostname, parsed.port
    except ValueError:
        raise LiveError(f"Ray address {address}: not HOST:PORT") from None
    if host is None or port is None:  # "auto", "local": Ray finds the cluster itself
        return
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
        if parsed.scheme == "gcs":  # something answers: ask it as Ray's GCS
            _ask_gcs(address)
    except OSError as err:
        reason = "no answer" if isinstance(err, TimeoutError) else err.strerror or str(err)
        raise LiveError(f"no Ray cluster answers at {address} ({reason})") from None


def _ask_gcs(address: str) -> None:
    """One read from the GCS at `address`, bounded in time; ConnectionError if none is there."""
    from ray._raylet import GcsClient
    from ray.exceptions import AuthenticationError, RayError

    try:
        GcsClient(address=address).internal_kv_get(
            b"groupflow_probe", None, timeout=CONNECT_TIMEOUT_S
        )
    except AuthenticationError:
        raise  # a cluster is there; it wants the token (groupflow/errors.py: AUTH_HINT)
    except RayError as err:
        raise ConnectionError(f"not a Ray GCS: {first_line(err)}") from None


def join_ray(address: str | None, **init_kwargs) -> None:
    """ray.init at `address` (None: start a local cluster), failing in seconds with one line
    naming the address when nothing answers there."""
    import ray

    if address is not None:
        _probe(address)
    try:
        ray.init(address=address, **init_kwargs)
    except ConnectionError as err:
        raise LiveError(f"cannot join the Ray cluster at {address}: {err}") from None


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


def _pid_alive(pid: int) -> bool:
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


def local_target(name: str, runs_dir: Path) -> Target | None:
    """The run trained from this machine called `name` (a run name or directory), from its
    run record; None when there is none."""
    for run_dir in (Path(name), runs_dir / name):
        path = run_dir / CLUSTER_FILE
        if not path.is_file():
            continue
        record = read_run_record(path)
        if record.host == socket.gethostname() and not _pid_alive(record.pid):
            raise LiveError(
                f"run {record.run} is not running (its driver, pid {record.pid}, has ended)"
            )
        return Target(
            record.run,
            record.gcs_address,
            auth_mode=record.auth_mode,
            host=record.host,
            pid=record.pid,
        )
    return None


def ray_address_for(dashboard: str, override: str | None) -> str:
    """What ray.init connects to for the cluster whose dashboard is `dashboard`: the
    override (or $GROUPFLOW_RAY_ADDRESS), "auto" on the head itself, else its Ray Client port."""
    override = override or os.environ.get(RAY_ADDRESS_ENV)
    if override:
        return override
    host = urlparse(dashboard if "://" in dashboard else f"http://{dashboard}").hostname or ""
    if host in LOCAL_HOSTS or host == socket.gethostname():
        return "auto"
    return f"ray://{host}:{RAY_CLIENT_PORT}"


def _job_target(name: str, client, dashboard: str, ray_address: str | None) -> Target:
    from ray.job_submission import JobStatus

    jobs = client.list_jobs()
    by_id = [j for j in jobs if name in (j.submission_id, j.job_id)]
    by_run = [j for j in jobs if (j.metadata or {}).get("groupflow_run") == name]
    matches = by_id or by_run
    if not matches:
        raise LiveError(f"no running run or job named {name} (none on {dashboard})")
    running = [j for j in matches if j.status == JobStatus.RUNNING]
    if not running:
        latest = max(matches, key=lambda j: j.start_time or 0)
        raise LiveError(
            f"job {latest.submission_id or latest.job_id} is not running ({latest.status.value})"
        )
    job = running[-1]
    run = (job.metadata or {}).get("groupflow_run")
    if run is None:
        raise LiveError(f"job {name} is not a groupflow job (no groupflow_run in its metadata)")
    return Target(run, ray_address_for(dashboard, ray_address), job.submission_id or job.job_id)


def locate(
    name: str, runs_dir: Path, client_factory, dashboard: str, ray_address: str | None
) -> Target:
    """The running job called `name` (a run name, a run directory, or a job id)."""
    local = local_target(name, runs_dir)
    if local is not None:
        return local
    try:
        client = client_factory(dashboard)
    except ConnectionError as err:
        raise LiveError(
            f"no run named {name} is running here (no {runs_dir / name / CLUSTER_FILE}), and "
            f"no Ray cluster at {dashboard} to look for a job ({first_line(err)})"
        ) from None
    return _job_target(name, client, dashboard, ray_address)


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
    try:
        return ray.get_actor(control_actor_name(target.run), namespace=CONTROL_NAMESPACE)
    except ValueError:
        raise LiveError(
            f"run {target.run} is not running (no control actor on its cluster)"
        ) from None


def live_status(actor, timeout_s: float = 10.0) -> tuple[LiveStatus | None, bool]:
    import ray

    status, waiting = ray.get(actor.status.remote(), timeout=timeout_s)
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
    refusal = ray.get(actor.request.remote(engines, reward_workers), timeout=30)
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
    """Ask the job to stop (groupflow/stopping.py) and wait for it to end, printing the line
    that says what it wrote. False when it has not ended within `timeout_s`."""
    import ray

    try:
        ray.get(actor.stop.remote(now), timeout=30)
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
            line = ray.get(actor.end_line.remote(), timeout=10)
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
    aborts at once; groupflow/stopping.py); what was done."""
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
