"""Ray nodes of a test's own, started with `ray start` and stopped by their own processes: a
bare `ray stop` would end every Ray cluster on the machine.

`ray start` runs in a session of its own, and every process of its node (raylet, log monitor,
agents, the workers that rename themselves `ray::...`) keeps that session id, even once
re-parented to init: the node is exactly the processes of that session. Each node gets free
ports for everything Ray would otherwise bind at a fixed default, and a short temp dir of its
own (Ray keeps unix sockets there; a path past 107 characters fails).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil

RAY = str(Path(sys.executable).parent / "ray")

# Node death noticed in about 3 s instead of Ray's 15 (set on the head: the GCS runs the checks).
FAST_HEALTH_CHECKS = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
    "RAY_health_check_initial_delay_ms": "0",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_flags() -> list[str]:
    names = (
        "node-manager",
        "object-manager",
        "dashboard-agent-listen",
        "dashboard-agent-grpc",
        "runtime-env-agent",
        "metrics-export",
    )
    return [f"--{name}-port={free_port()}" for name in names]


class RayNode:
    """One `ray start` node (`args`: --head or --address=..., resources); `kill` ends every
    process of it at once, as a lost machine would."""

    def __init__(self, args: list[str], env: dict, name: str):
        self.temp_dir = Path(f"/tmp/gf-{name}-{os.getpid()}")
        proc = subprocess.Popen(
            [RAY, "start", *args, f"--temp-dir={self.temp_dir}", "--disable-usage-stats"]
            + _port_flags(),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        out, _ = proc.communicate(timeout=180)
        self.session = proc.pid
        if proc.returncode:
            self.stop()
            raise RuntimeError(f"ray start {' '.join(args)} failed:\n{out[-3000:]}")

    def processes(self) -> list[psutil.Process]:
        procs = []
        for p in psutil.process_iter():
            try:
                if p.pid != os.getpid() and os.getsid(p.pid) == self.session:
                    procs.append(p)
            except (ProcessLookupError, PermissionError, psutil.Error):
                continue
        return procs

    def kill(self) -> None:
        procs = self.processes()
        for p in procs:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                continue
        psutil.wait_procs(procs, timeout=15)

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
