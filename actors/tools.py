"""The tool pool: Ray actors that run the python tool's programs in the sandbox of the code
verifier (reward_workers/sandbox.py, docs/sandbox.md), sized apart from the engines
(`agent.tool_workers`), so that tools scale with what they cost and model-written code never
runs in an engine's process.

Each engine gets the pool's handles and sends each call to the worker with the fewest calls in
flight from it (`ToolPoolClient`). A worker that dies fails its calls as tool errors, which
the model reads and the figures count; the engines stop sending it work.
"""

from __future__ import annotations

import math

import ray

from groupflow.config import Config
from groupflow.reward_workers.sandbox import Limits, default_platform, require_strong, run_python
from groupflow.rollout.tools import ToolError

CALLS_PER_WORKER = 4  # sandboxes one worker runs at once (each is a process of its own)
MEMORY_MB = 512
OUTPUT_BYTES = 64 << 10


class ToolWorker:
    def __init__(self, allow_weak: bool):
        require_strong(default_platform(), allow_weak, "agent.tools python")

    def run(self, code: str, timeout_s: float) -> tuple[int, str, str, bool]:
        """(exit status, stdout, stderr, timed out) of `code` run as a program."""
        limits = Limits(
            wall_s=timeout_s,
            cpu_s=max(1, math.ceil(timeout_s)),
            memory_mb=MEMORY_MB,
            output_bytes=OUTPUT_BYTES,
        )
        result = run_python(code, limits)
        return result.returncode, result.stdout, result.stderr, result.timed_out


def start_tool_pool(cfg: Config) -> list:
    """The tool workers of a job whose tools include python; none otherwise."""
    if "python" not in cfg.agent_tools():
        return []
    res = cfg.reward.resources  # a tool worker costs what a reward worker does
    actor = ray.remote(ToolWorker).options(
        num_cpus=res.num_cpus, resources=res.custom, max_concurrency=CALLS_PER_WORKER
    )
    return [actor.remote(cfg.agent.allow_weak_sandbox) for _ in range(cfg.agent.tool_workers)]


class ToolPoolClient:
    """An engine's side of the pool: `run` is the python tool's RunCode (rollout/tools.py)."""

    def __init__(self, workers: list):
        self.workers = list(workers)
        self.in_flight = [0] * len(self.workers)
        self.dead: set[int] = set()

    async def run(self, code: str, timeout_s: float) -> tuple[int, str, str, bool]:
        live = [i for i in range(len(self.workers)) if i not in self.dead]
        if not live:
            raise ToolError("no tool worker is left")
        i = min(live, key=lambda k: self.in_flight[k])
        self.in_flight[i] += 1
        try:
            return await self.workers[i].run.remote(code, timeout_s)
        except ray.exceptions.RayActorError:
            self.dead.add(i)
            raise ToolError("the tool worker died") from None
        finally:
            self.in_flight[i] -= 1
