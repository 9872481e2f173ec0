"""What `groupflow status | logs | stop | scale RUN` act on. RUN is a run name
(trainer.run_name), a run directory, or a job id `groupflow submit` printed; `find_run` looks
for it in three places:

- the run directory: RUN itself when it is one, else <--runs>/RUN (runs trained here, and runs
  submitted to a cluster whose trainer.output_dir this machine sees);
- its record there (cluster.json) while it runs: how to reach it with no Jobs API;
- the Ray Jobs API at the cluster address (groupflow/run/cluster_address.py), by job id, or by run
  name (the submission's `groupflow_run` metadata; the running one, else the newest). It is
  asked only where the command needs it: always for `logs` and `stop`, for `status` and
  `scale` only when no live record is here. A run on disk needs no cluster: with none
  answering, it is what the command shows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from groupflow.run.cluster_address import AddressError, ClusterAddress, jobs_client, join_address
from groupflow.run.live import LiveError, Target
from groupflow.run.on_disk import RunOnDisk, is_run_dir, read_run

RUN_METADATA = "groupflow_run"  # the submission's metadata key naming its run


@dataclass
class Job:
    """A submission of the Jobs API."""

    id: str
    status: str  # JobStatus's value: PENDING, RUNNING, SUCCEEDED, FAILED, STOPPED
    run: str | None  # its run name, for a groupflow job
    start_time: int

    @classmethod
    def of(cls, details) -> Job:
        return cls(
            details.submission_id or details.job_id,
            details.status.value,
            (details.metadata or {}).get(RUN_METADATA),
            details.start_time or 0,
        )

    @property
    def running(self) -> bool:
        return self.status == "RUNNING"


def pick_job(name: str, jobs: list[Job]) -> Job | None:
    """The job `name` means: the one with that id, else of the run of that name (the running
    one, else the newest)."""
    by_id = [j for j in jobs if j.id == name]
    if by_id:
        return by_id[0]
    by_run = [j for j in jobs if j.run == name]
    if not by_run:
        return None
    return max(by_run, key=lambda j: (j.running, j.start_time))


@dataclass
class FoundRun:
    """What RUN names: its run directory here, its job on the cluster, either or both."""

    name: str
    address: ClusterAddress
    run_dir: RunOnDisk | None = None
    job: Job | None = None
    client: object | None = None  # the Jobs client, when the cluster was asked and answered
    unreachable: str | None = None  # why the cluster was not asked, when it did not answer

    @property
    def run_name(self) -> str:
        if self.job is not None and self.job.run is not None:
            return self.job.run
        return self.run_dir.name if self.run_dir is not None else self.name

    def live_target(self) -> Target:
        """How to reach the running job's control actor; a LiveError saying why not."""
        local = self.run_dir
        if local is not None and local.state == "running" and local.record is not None:
            record = local.record
            return Target(
                record.run,
                record.gcs_address,
                auth_mode=record.auth_mode,
                host=record.host,
                pid=record.pid,
            )
        if self.job is not None and self.job.running:
            if self.job.run is None:
                raise LiveError(f"job {self.job.id} is not a groupflow job (no {RUN_METADATA})")
            try:
                ray_address = join_address(self.address, self.client)
            except AddressError as err:
                raise LiveError(str(err)) from None
            return Target(self.job.run, ray_address, self.job.id)
        if self.job is not None:
            raise LiveError(f"job {self.job.id} is not running ({self.job.status})")
        if local is not None and local.state == "failed" and local.record is not None:
            raise LiveError(
                f"run {local.name} is not running (its driver, pid {local.record.pid}, has ended)"
            )
        if local is not None:
            raise LiveError(f"run {local.name} is not running ({local.state}; {local.path})")
        raise self.not_found()

    def no_job(self) -> str:
        """Why no job was found, for an error line."""
        if self.unreachable is not None:
            return f"no Ray cluster answers at {self.unreachable}"
        return f"no job of that id or run on {self.address}"

    def not_found(self) -> LiveError:
        return LiveError(f"no run or job named {self.name}: no run directory here; {self.no_job()}")


def _local_run(name: str, runs_dir: Path) -> RunOnDisk | None:
    for path in (Path(name), runs_dir / name):
        if is_run_dir(path):
            return read_run(path)
    return None


def find_run(name: str, runs_dir: Path, address: ClusterAddress, need_job: bool) -> FoundRun:
    """Where RUN is: its run directory here, and (with `need_job`, or where no live record is
    here) its job on the cluster at `address`. A cluster that does not answer is an error
    only when nothing else was found."""
    found = FoundRun(name, address, run_dir=_local_run(name, runs_dir))
    live_here = found.run_dir is not None and found.run_dir.state == "running"
    if live_here and not need_job:
        return found
    try:
        found.client = jobs_client(address)
    except AddressError as err:
        if found.run_dir is None:
            raise LiveError(
                f"no run or job named {name}: no run directory here, and {err}"
            ) from None
        found.unreachable = str(address)
        return found
    jobs = [Job.of(j) for j in found.client.list_jobs()]
    found.job = pick_job(name, jobs)
    if found.job is None and found.run_dir is not None:  # RUN was a directory: its run's name
        found.job = pick_job(found.run_dir.name, jobs)
    if found.job is None and found.run_dir is None:
        raise found.not_found()
    return found
