"""The tool pool: Ray actors that run the python tool's programs in the sandbox of the code
verifier (reward_workers/sandbox.py, docs/sandbox.md), sized apart from the engines
(`agent.tool_workers`), so that tools scale with what they cost and model-written code never
runs in an engine's process.

Each engine gets the pool's handles and sends each call to the worker with the fewest calls in
flight from it (`ToolPoolClient`). A worker holds no state, so one that dies is restarted by
Ray under the same handle (`max_restarts`, on another node if its own is gone). The calls it
was running, and those that reach it while it restarts, are sent again, to another worker if
one is up, until they run or `agent.tool_timeout_s` ends them: a program runs in a sandbox of
its own, so running it twice changes nothing outside it.
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray

from groupflow.config import Config
from groupflow.rollout.tools import require_sandbox, run_in_sandbox

log = logging.getLogger(__name__)

CALLS_PER_WORKER = 4  # sandboxes one worker runs at once (each is a process of its own)
RETRY_AFTER_S = 1.0  # a worker that failed a call gets no call for this long


class ToolWorker:
    def __init__(self, allow_weak: bool):
        require_sandbox(allow_weak)

    def run(self, code: str, timeout_s: float) -> tuple[int, str, str, bool]:
        """(exit status, stdout, stderr, timed out) of `code` run as a program."""
        return run_in_sandbox(code, timeout_s)


def start_tool_pool(cfg: Config) -> list:
    """The tool workers of a job whose tools include python; none otherwise."""
    if "python" not in cfg.agent_tools():
        return []
    res = cfg.reward.resources  # a tool worker costs what a reward worker does
    actor = ray.remote(ToolWorker).options(
        num_cpus=res.num_cpus,
        resources=res.custom,
        max_concurrency=CALLS_PER_WORKER,
        max_restarts=-1,  # stateless: a restart costs a process start, never a result
        max_task_retries=0,  # the client sends a failed call again, elsewhere if it can
    )
    return [actor.remote(cfg.agent.allow_weak_sandbox) for _ in range(cfg.agent.tool_workers)]


class ToolPoolClient:
    """An engine's side of the pool: `run` is the python tool's RunCode (rollout/tools.py)."""

    def __init__(self, workers: list):
        self.workers = list(workers)
        self.in_flight = [0] * len(self.workers)
        self.resting_until = [0.0] * len(self.workers)

    async def run(self, code: str, timeout_s: float) -> tuple[int, str, str, bool]:
        while True:  # the caller's deadline (ToolBox) ends the retries
            now = time.monotonic()
            up = [i for i, until in enumerate(self.resting_until) if until <= now]
            if not up:
                await asyncio.sleep(min(self.resting_until) - now)
                continue
            i = min(up, key=lambda k: self.in_flight[k])
            self.in_flight[i] += 1
            try:
                return await self.workers[i].run.remote(code, timeout_s)
            except ray.exceptions.RayActorError as err:  # dead, or restarting
                if self.resting_until[i] <= time.monotonic():
                    log.warning("tool worker %d failed a call, sent again: %s", i, err)
                self.resting_until[i] = time.monotonic() + RETRY_AFTER_S
            finally:
                self.in_flight[i] -= 1
