"""Where the python tool's programs run (its `RunCode`, rollout/python_tool.py), in the sandbox
of the code verifier (reward_workers/sandbox/, docs/sandbox.md): the tool pool of Ray actors,
sized apart from the engines (`agent.tool_workers`), so that tools scale with what they cost
and model-written code never runs in an engine's process; or, for `groupflow eval`, which has
no pool, sandboxes started from its own process (`in_process_run_code`). This layer hands the
runner to the engines, so that rollout/ never imports the reward side's sandbox.

Each engine gets the pool's handles and sends each call to the worker with the fewest calls in
flight from it (`ToolPoolClient`). A worker holds no state, so one that dies is restarted by
Ray under the same handle (`max_restarts`, on another node if its own is gone). The calls it
was running, and those that reach it while it restarts, are sent again, to another worker if
one is up, until they run or `agent.tool_timeout_s` ends them: a program runs in a sandbox of
its own, so running it twice changes nothing outside it. A call that lost its worker and found
no other to run it gives up shortly before that deadline, as `ToolWorkerLost`: its trajectory
failed for a reason not the model's and is masked, where a timeout would be counted against
the model's program.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

import ray

from groupflow.config import Config
from groupflow.core.threads import thread_env
from groupflow.reward_workers.sandbox import Limits, default_platform, require_strong, run_python
from groupflow.rollout.python_tool import RunCode
from groupflow.rollout.toolbox import ToolWorkerLost
from groupflow.rollout.user_calls import LOOP_WATCH, UserCalls

log = logging.getLogger(__name__)

CALLS_PER_WORKER = 4  # sandboxes one worker runs at once (each is a process of its own)
RETRY_AFTER_S = 1.0  # a worker that failed a call gets no call for this long
# A call that lost its worker gives up this long before the ToolBox's deadline (at most a
# tenth of it), so that it ends as a lost worker and not as the program's timeout.
LOST_MARGIN_S = 0.5
PROGRAM_MEMORY_MB = 512
PROGRAM_OUTPUT_BYTES = 64 << 10


def run_program(code: str, timeout_s: float) -> tuple[int, str, str, bool]:
    """(exit status, stdout, stderr, timed out) of `code` run as a program in the sandbox,
    within `timeout_s` of wall-clock and as many CPU seconds."""
    limits = Limits(
        wall_s=timeout_s,
        cpu_s=max(1, math.ceil(timeout_s)),
        memory_mb=PROGRAM_MEMORY_MB,
        output_bytes=PROGRAM_OUTPUT_BYTES,
    )
    result = run_python(code, limits)
    return result.returncode, result.stdout, result.stderr, result.timed_out


def require_sandbox(allow_weak: bool) -> None:
    """Refuse, in one line, a platform whose sandbox lacks its kernel layers unless allowed."""
    require_strong(default_platform(), allow_weak, "agent.tools python")


def in_process_run_code(allow_weak: bool) -> RunCode:
    """The python tool's programs started from this process, in threads of their own (neither
    users' tools' nor the calculator's): for `groupflow eval`, which has no tool pool."""
    require_sandbox(allow_weak)
    programs = UserCalls(CALLS_PER_WORKER, "python-tool", LOOP_WATCH)

    async def run(code: str, timeout_s: float) -> tuple[int, str, str, bool]:
        return await programs.call(run_program, code, timeout_s)

    return run


class ToolWorker:
    def __init__(self, allow_weak: bool):
        require_sandbox(allow_weak)

    def run(self, code: str, timeout_s: float) -> tuple[int, str, str, bool]:
        """(exit status, stdout, stderr, timed out) of `code` run as a program."""
        return run_program(code, timeout_s)


def start_tool_pool(cfg: Config) -> list:
    """The tool workers of a job whose tools include python; none otherwise."""
    if "python" not in cfg.agent_tools():
        return []
    res = cfg.reward.resources  # a tool worker costs what a reward worker does
    actor = ray.remote(ToolWorker).options(
        num_cpus=res.num_cpus,
        resources=res.custom,
        runtime_env={"env_vars": thread_env(res.threads)},  # its programs' too
        max_concurrency=CALLS_PER_WORKER,
        max_restarts=-1,  # stateless: a restart costs a process start, never a result
        max_task_retries=0,  # the client sends a failed call again, elsewhere if it can
    )
    return [actor.remote(cfg.agent.allow_weak_sandbox) for _ in range(cfg.agent.tool_workers)]


class ToolPoolClient:
    """An engine's side of the pool: `run` is the python tool's RunCode."""

    def __init__(self, workers: list):
        self.workers = list(workers)
        self.in_flight = [0] * len(self.workers)
        self.resting_until = [0.0] * len(self.workers)

    async def run(self, code: str, timeout_s: float) -> tuple[int, str, str, bool]:
        give_up = time.monotonic() + timeout_s - min(LOST_MARGIN_S, timeout_s / 10)
        lost = None  # why the call has no worker, once it lost one (or found none up)
        while True:  # the caller's deadline (ToolBox) ends the retries
            now = time.monotonic()
            if lost is not None and now >= give_up:
                raise ToolWorkerLost(f"the tool worker was lost ({lost}) and none ran it in time")
            up = [i for i, until in enumerate(self.resting_until) if until <= now]
            if not up:
                lost = lost or "no tool worker up"
                await asyncio.sleep(max(0.0, min(min(self.resting_until), give_up) - now))
                continue
            i = min(up, key=lambda k: self.in_flight[k])
            call = self.workers[i].run.remote(code, timeout_s)
            self.in_flight[i] += 1
            try:
                if lost is None:
                    return await call
                return await asyncio.wait_for(call, max(0.0, give_up - time.monotonic()))
            except TimeoutError:
                ray.cancel(call)  # a retry nobody waits for any more
                lost = lost or "the retry did not finish"
            except asyncio.CancelledError:
                # the caller gave up (its deadline): a call still queued at the worker would
                # run ahead of other trajectories' calls for nobody (a running program ends
                # at its own wall-clock limit)
                ray.cancel(call)
                raise
            except ray.exceptions.RayActorError as err:  # dead, or restarting
                if self.resting_until[i] <= time.monotonic():
                    log.warning("tool worker %d failed a call, sent again: %s", i, err)
                self.resting_until[i] = time.monotonic() + RETRY_AFTER_S
                lost = type(err).__name__
            finally:
                self.in_flight[i] -= 1
