"""`groupflow submit | status | logs | stop | scale | list`: training jobs on a Ray cluster, via
the Ray Jobs API; `scale` and the live part of `status` reach a running job's control actor
(groupflow/run/live.py). Every command takes one cluster address (groupflow/run/cluster_address.py), and
RUN is a run name, a run directory or a job id (groupflow/run/target.py).

How `submit` carries the config. The config is validated here first (a bad key fails at once,
exit 2, before any cluster is contacted). The resolved config (file + `--set` + preset
defaults, as `groupflow config` prints it) is then written as `groupflow-job.yaml` into an
otherwise empty temporary directory, and that directory is the job's `working_dir`: Ray
uploads it with the submission and every process of the job (the driver and all actors, on
every node) starts in its own copy. The entrypoint is
`python -m groupflow.run.cli train groupflow-job.yaml`, so the job runs exactly the config that was
checked, and nothing from the submitting machine's disk is read later.

What the cluster needs.
- groupflow and its dependencies installed, on every node, in the Python that Ray runs jobs
  with (`python` on the PATH of the Ray processes): deploy/Dockerfile builds that image for
  the CUDA stack. `--ship-code` additionally uploads the local source packages as
  `py_modules`, which take precedence over the installed copy: a way to run local edits on a
  cluster whose image has the dependencies.
- Paths in the config are read on the cluster: `model.path`, a reward plugin file, dataset
  files. A relative one that exists here is sent as its absolute path here, and one that is
  not here is refused (groupflow/run/submit_paths.py). `trainer.output_dir` is written there too,
  by the driver on the head node and by learner rank 0 (the model) on its node, so on a
  multi-node cluster it must be storage mounted at the same path on those nodes; a relative
  one is refused, as it would end up inside the job's temporary working directory. The quickstart model is cached under `GROUPFLOW_CACHE`,
  which must likewise be shared storage when engines and ranks run on other nodes.
- A cluster with token authentication (what `ray start` turns on in Ray 2.60 when a token
  exists) wants `RAY_AUTH_MODE=token` here and the token in `RAY_AUTH_TOKEN` or
  ~/.ray/auth_token, as Ray's own `ray job` commands do.
- For the Prometheus endpoint, set `metrics.prometheus_port`; the exporter runs in the driver,
  which is on the head node.

A submitted job has `trainer.resume: auto` unless its config sets it: submitted again under
the same run name (by a person, or by RayJob's backoffLimit), it goes on from the run's newest
checkpoint (`trainer.checkpoint_every`) instead of starting over.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import shutil
import sys
import tempfile
import time
from pathlib import Path

from groupflow.core.errors import UserError, first_line
from groupflow.run.cluster_address import (
    DEFAULT_ADDRESS,
    DOCS,
    AddressError,
    ClusterAddress,
    jobs_client,
)
from groupflow.run.live import positive_seconds

JOB_COMMANDS = ("submit", "status", "logs", "stop", "scale", "list")
JOB_CONFIG_NAME = "groupflow-job.yaml"
ENTRYPOINT = f"python -m groupflow.run.cli train {JOB_CONFIG_NAME}"
# The design card's folders, installed as groupflow.<name>: pyproject.toml's package-dir is
# the list (tests/unit/test_packaging.py checks this copy against it).
SUBPACKAGES = ("actors", "rollout", "learner", "reward_workers")
STATUS_POLL_S = 1.0
RUN_HELP = "run name (trainer.run_name), run directory, or the job id `groupflow submit` printed"
# How long `groupflow stop` waits for the job to end: the step in flight (its samples within
# trainer.stop_timeout_s), its learning, a checkpoint and the model's save.
STOP_TIMEOUT_S = 900.0
NOW_TIMEOUT_S = 30.0  # for `stop --now`: the job looks for it every few seconds


def _add_address(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--address",
        default=None,
        help="the Ray cluster: its dashboard URL (http://HEAD:8265), its GCS address "
        f"(HEAD:6379), ray://HEAD:10001 or auto; default: $RAY_ADDRESS, else {DEFAULT_ADDRESS} "
        f"(see {DOCS})",
    )


def _add_runs(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--runs",
        default="runs",
        metavar="DIR",
        help="where run directories are looked for (trainer.output_dir; default: runs)",
    )


def _add_run(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUN", help=RUN_HELP)
    _add_address(p)
    _add_runs(p)


def _add_scale_command(subparsers: argparse._SubParsersAction) -> None:
    scale = subparsers.add_parser(
        "scale",
        help="change the engines and reward workers of a running job",
        description="Change how many vLLM engines and reward workers a running job has. RUN is "
        "a run name (trainer.run_name), a run directory, or the job id `groupflow submit` "
        "printed. The job applies the change between steps and trains on meanwhile: new "
        "engines load the current weights before their first chunk, removed ones finish "
        "the chunks they hold. Waits until the change is complete (saying so while the "
        "cluster has no room for new actors) unless --no-wait.",
    )
    _add_run(scale)
    scale.add_argument("--engines", type=int, metavar="N", help="generator engines wanted")
    scale.add_argument("--reward-workers", type=int, metavar="M", help="reward workers wanted")
    scale.add_argument("--no-wait", action="store_true", help="return once the job has the request")
    scale.add_argument(
        "--timeout",
        type=positive_seconds,
        default=900.0,
        metavar="S",
        help="seconds to wait for the change (default 900); the request stands after that",
    )


def _add_stop_command(subparsers: argparse._SubParsersAction) -> None:
    stop = subparsers.add_parser(
        "stop",
        help="stop a running job, keeping its work",
        description="Ask a running job to stop, as Ctrl-C does: it finishes the step in "
        "flight (abandoned when its samples are not in within trainer.stop_timeout_s), then "
        "writes its checkpoint (with trainer.checkpoint_every), model, plots and summary.json, "
        "and ends. Prints what it wrote and how to resume. RUN is a run name "
        "(trainer.run_name), a run directory, or the job id `groupflow submit` printed. A job "
        "not ended within --timeout, or not reachable yet (still starting), is stopped "
        "through the Ray Jobs API (a run trained here: its driver is sent SIGTERM), which "
        "writes nothing more.",
    )
    _add_run(stop)
    stop.add_argument(
        "--now",
        "--force",
        action="store_true",
        help="end at once, writing nothing more (the newest checkpoint stays the newest)",
    )
    stop.add_argument(
        "--timeout",
        type=positive_seconds,
        default=STOP_TIMEOUT_S,
        metavar="S",
        help=f"seconds to wait for the job to end (default {STOP_TIMEOUT_S:g}) before "
        "stopping it through the Ray Jobs API",
    )


def add_job_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add `submit`, `status`, `logs`, `stop`, `scale` and `list` to the `groupflow` command's
    subparsers."""
    submit = subparsers.add_parser(
        "submit",
        help="submit a training job to a Ray cluster and follow its logs",
        description="Validate the config here, then run `groupflow train` with it on the "
        "cluster at --address through the Ray Jobs API. Prints the job id; follows the logs "
        "until the job ends (exit 0 if it succeeded) unless --no-follow.",
    )
    submit.add_argument(
        "config", nargs="?", help="YAML config file (default: the built-in quickstart)"
    )
    submit.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key, e.g. --set trainer.steps=50 (repeatable; values are YAML)",
    )
    _add_address(submit)
    submit.add_argument("--no-follow", action="store_true", help="return once submitted")
    submit.add_argument(
        "--ship-code",
        action="store_true",
        help="upload the local groupflow source with the job (it overrides the installed copy)",
    )
    for name, text in (
        (
            "status",
            "show a run's state: while it runs, its live engines, reward workers and learner "
            "ranks; once ended, what its run directory holds (no cluster needed)",
        ),
        ("logs", "print a job's logs (a run trained here: its driver.log)"),
    ):
        p = subparsers.add_parser(name, help=text, description=text)
        _add_run(p)
        if name == "logs":
            p.add_argument("--follow", action="store_true", help="keep printing until it ends")
    listing = subparsers.add_parser(
        "list",
        help="list the runs here and the jobs on the cluster",
        description="The run directories in --runs (state, steps done of trainer.steps, "
        "held-out accuracy before -> after) and, when a cluster answers at --address, its "
        "submitted jobs.",
    )
    _add_address(listing)
    _add_runs(listing)
    _add_stop_command(subparsers)
    _add_scale_command(subparsers)


class ClusterError(UserError):
    """A request the Ray Jobs API refused (an unknown job, a failed request)."""

    exit_code = 1


def _package_dir(name: str) -> Path:
    # find_spec locates a package without importing it (importing would pull in torch).
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"--ship-code: package {name!r} not found locally")
    return Path(spec.submodule_search_locations[0])


def stage_source(dest: Path) -> Path:
    """One `groupflow` package directory as installed (the design card's folders inside it),
    built from the local source: what --ship-code uploads."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    package = dest / "groupflow"
    shutil.copytree(_package_dir("groupflow"), package, ignore=ignore)
    for name in SUBPACKAGES:
        source = _package_dir(f"groupflow.{name}")
        shutil.copytree(source, package / name, ignore=ignore, dirs_exist_ok=True)
    return package


def job_runtime_env(config_dir: Path, code: Path | None = None) -> dict:
    """The runtime environment of a submitted job: the config directory as working_dir, and
    the staged source package when --ship-code."""
    env: dict = {"working_dir": str(config_dir)}
    if code is not None:
        env["py_modules"] = [str(code)]
    return env


def _submit(args: argparse.Namespace) -> int:
    from groupflow.run.job_config import load_config
    from groupflow.run.target import RUN_METADATA

    cfg = load_config(args.config, args.overrides)
    if cfg.trainer.resume is None:
        # A resubmission under the same run name (a person's, or RayJob's backoffLimit)
        # continues from the run's newest checkpoint instead of starting over.
        cfg.trainer.resume = "auto"
    from groupflow.run.submit_paths import absolute_for_cluster

    made_absolute = absolute_for_cluster(cfg, Path.cwd())  # or one line naming the key
    if made_absolute:
        print(
            "groupflow: note: relative paths sent as absolute ones, which the cluster's nodes "
            f"must be able to read: {', '.join(made_absolute)}",
            file=sys.stderr,
        )
    client = jobs_client(ClusterAddress.given(args.address))
    with (
        tempfile.TemporaryDirectory(prefix="groupflow-job-") as config_dir,
        tempfile.TemporaryDirectory(prefix="groupflow-code-") as code_dir,
    ):
        (Path(config_dir) / JOB_CONFIG_NAME).write_text(cfg.dump_yaml())
        code = stage_source(Path(code_dir)) if args.ship_code else None
        # submit_job uploads both directories before it returns, so they can go.
        job_id = client.submit_job(
            entrypoint=ENTRYPOINT,
            runtime_env=job_runtime_env(Path(config_dir), code),
            metadata={RUN_METADATA: cfg.trainer.run_name},
        )
    print(job_id, flush=True)
    if args.no_follow:
        return 0
    return _follow(client, job_id)


async def _print_log_stream(client, job_id: str) -> None:
    async for chunk in client.tail_job_logs(job_id):
        print(chunk, end="", flush=True)


def _wait_until_ended(client, job_id: str):
    # The log stream closes when the driver exits; the recorded status can trail it briefly.
    while not (status := client.get_job_status(job_id)).is_terminal():
        time.sleep(STATUS_POLL_S)
    return status


def _follow(client, job_id: str) -> int:
    from ray.job_submission import JobStatus

    try:
        asyncio.run(_print_log_stream(client, job_id))
    except KeyboardInterrupt:
        print(
            f"\ngroupflow: stopped following; job {job_id} keeps running "
            f"(`groupflow stop {job_id}` ends it)",
            file=sys.stderr,
        )
        return 130
    status = _wait_until_ended(client, job_id)
    print(f"groupflow: job {job_id} {status.value}", file=sys.stderr)
    return 0 if status == JobStatus.SUCCEEDED else 1


def _found(args: argparse.Namespace, need_job: bool):
    from groupflow.run.target import find_run

    return find_run(args.run, Path(args.runs), ClusterAddress.given(args.address), need_job)


def _job_lines(client, job) -> list[str]:
    """A submitted job's state and run, and its message: a failed job's ends with up to
    20,000 characters of its log, of which its first line and the log's last line (the
    error) are what a status needs."""
    message = (client.get_job_info(job.id).message or "").strip().splitlines()
    return [f"{job.id}  {job.status}  run={job.run or '-'}", *message[:1], *message[1:][-1:]]


def _status(args: argparse.Namespace) -> int:
    from groupflow.run import live

    found = _found(args, need_job=False)
    job, local = found.job, found.run_dir
    if job is not None:
        print("\n".join(_job_lines(found.client, job)))
    if job is not None and job.running:
        try:
            live.print_live(live.connect(found.live_target()))
        except Exception as err:  # the job's own status stands without the live part
            # whole, on one line: Ray's messages run over several, and cut they mislead
            print(f"live: unavailable ({' '.join(str(err).split()) or type(err).__name__})")
    elif local is not None and local.state == "running":
        host = local.record.host if local.record is not None else None
        print(f"run {local.name}  RUNNING  (driver on {host or 'this machine'})")
        live.print_live(live.connect(found.live_target()))
    elif local is not None:
        print("\n".join(local.lines()))
    return 0


def _scale(args: argparse.Namespace) -> int:
    from groupflow.run import live

    live.check_counts(args.engines, args.reward_workers)
    actor = live.connect(_found(args, need_job=False).live_target())
    return live.scale(
        actor, args.engines, args.reward_workers, wait=not args.no_wait, timeout_s=args.timeout
    )


def _follow_file(path: Path, running) -> None:
    """Print `path`, then what is appended to it while `running()`."""
    with path.open("rb") as f:
        while True:
            chunk = f.read()
            if chunk:
                sys.stdout.write(chunk.decode("utf-8", "replace"))
                sys.stdout.flush()
            elif not running():
                return
            else:
                time.sleep(STATUS_POLL_S)


def _logs(args: argparse.Namespace) -> int:
    from groupflow.observe.driver_log import FILE_NAME as DRIVER_LOG
    from groupflow.run.live import LiveError
    from groupflow.run.on_disk import read_run

    found = _found(args, need_job=True)
    if found.job is not None:
        if args.follow:
            asyncio.run(_print_log_stream(found.client, found.job.id))
        else:
            print(found.client.get_job_logs(found.job.id), end="")
        return 0
    log = found.run_dir.path / DRIVER_LOG
    if not log.is_file():
        raise LiveError(
            f"run {found.run_dir.name} has no {log}, and {found.no_job()}: its log is what "
            "`groupflow train` printed"
        )
    _follow_file(log, lambda: args.follow and read_run(log.parent).state == "running")
    return 0


def _stop_through_jobs_api(client, job_id: str) -> int:
    if client.stop_job(job_id):
        print(f"stopped {job_id} through the Ray Jobs API (SIGTERM, then SIGKILL)")
    else:
        status = client.get_job_status(job_id)
        print(f"{job_id} had already ended ({status.value})")
    return 0


def _stop(args: argparse.Namespace) -> int:
    """Through the job's control actor (groupflow/run/live.py `stop`), so that it ends as
    Ctrl-C ends it; the Jobs API (or a local driver's SIGTERM) when that cannot be had."""
    from groupflow.run import live

    found = _found(args, need_job=False)
    submitted = found.job is not None and found.job.running
    target = actor = None
    try:
        target = found.live_target()  # a LiveError when the run is not running
        actor = live.connect(target)
    except live.LiveError as err:
        if target is None and not submitted:
            raise
        print(f"{first_line(err)}; stopping it at once")  # e.g. still starting
    timeout_s = NOW_TIMEOUT_S if args.now else args.timeout
    if actor is not None:
        if live.stop(actor, args.now, timeout_s):
            return 0
        print(f"the job has not ended in {timeout_s:g}s; stopping it at once")
    if submitted:
        return _stop_through_jobs_api(found.client, found.job.id)
    print(live.signal_driver(target))
    return 0


def table(rows: list[list[str]]) -> list[str]:
    """Rows as lines of left-aligned columns, two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def _list(args: argparse.Namespace) -> int:
    from groupflow.run.on_disk import runs_in
    from groupflow.run.target import Job

    runs = runs_in(Path(args.runs))
    if runs:
        head = ["RUN", "STATE", "STEP", "ACCURACY", "DIRECTORY"]
        rows = [[r.name, r.state, r.progress(), r.accuracy_text(), str(r.path)] for r in runs]
        print("\n".join(table([head, *rows])))
    else:
        print(f"no runs in {args.runs}")
    address = ClusterAddress.given(args.address)
    try:
        client = jobs_client(address)
    except AddressError:
        print(f"jobs: no Ray cluster answers at {address}")
        return 0
    jobs = sorted((Job.of(j) for j in client.list_jobs()), key=lambda j: -j.start_time)
    if jobs:
        rows = [[j.id, j.status, j.run or "-"] for j in jobs]
        print("\n" + "\n".join(table([["JOB", "STATUS", "RUN"], *rows])))
    else:
        print(f"jobs: none on {address}")
    return 0


HANDLERS = {
    "submit": _submit,
    "status": _status,
    "logs": _logs,
    "stop": _stop,
    "scale": _scale,
    "list": _list,
}


def run_job_handler(args: argparse.Namespace) -> int:
    """Run a parsed job command: 0 on success, 1 for a submitted job that did not succeed.
    The Jobs client reports an unknown job or a refused request as a bare RuntimeError: it
    is made a ClusterError here, the one place that calls it. The command line
    (groupflow/run/cli.py: main) makes every expected failure one line: 2 for a bad config or
    count, 1 for cluster problems (unreachable, unknown job, a job that is not running, a
    scale request the job refused)."""
    try:
        return HANDLERS[args.command](args)
    except RuntimeError as err:
        if isinstance(err, UserError):
            raise
        raise ClusterError(first_line(err)) from None
