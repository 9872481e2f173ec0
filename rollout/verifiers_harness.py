"""verifiers' own program as a harness (`agent.harness`, set for a multi-turn `task.name:
verifiers:<taskset>`, docs/environments.md): each trajectory runs the taskset's agent program
against the trajectory's endpoint and returns the trace verifiers recorded.

Why the trace, and the scoring on the reward side: a harness returns what the verifier scores
(rollout/harness.py), and a verifiers task's rewards read the whole conversation (its turns,
its tool calls), not one reply. So the program runs here with its scoring deferred
(`Task.defer_scoring`: its setup and finalize hooks still run), and the trace, as verifiers'
own JSON, is the answer; the reward worker reads it back and runs the task's rewards on it
(reward_workers/tasks/verifiers_task.py), as for a single-turn taskset. What trains is not
the trace's text: it is what the endpoint recorded of the same calls, the engine's own ids
(rollout/harness_record.py).

The program is verifiers' `Agent` with the taskset's own harness, in verifiers' subprocess
runtime on this host (the taskset's checks, at the task's start, refuse a harness that needs
a container or runs the model's commands). Its model calls go through verifiers' interception
server to the endpoint, as verifiers does with any OpenAI-compatible endpoint. A rollout that
ended in an error (the program failed, a call was refused, a task hook raised) is raised here:
the harness contract makes it an infrastructure failure, masked, never a 0 trained on.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
from typing import Any

from groupflow.core.records import Prompt

# verifiers reads an endpoint's key from an environment variable (its client config names the
# variable, never the key): the engine's endpoint key, the same for all its trajectories.
KEY_VARIABLE = "GROUPFLOW_ENDPOINT_KEY"


@functools.lru_cache(maxsize=8)
def _taskset(config_json: str) -> Any:
    import verifiers.v1 as vf

    config = json.loads(config_json)
    return vf.load_taskset(vf.taskset_config_type(config["id"]).model_validate(config))


def task_of(row: Prompt) -> Any:
    """The verifiers task a row of a multi-turn taskset stands for: its taskset's config and
    its data travel in the row's answer."""
    taskset = _taskset(json.dumps(row.answer["taskset"], sort_keys=True))
    task_cls = type(taskset).task_type()
    return task_cls(task_cls.data_type().model_validate(row.answer["data"]), taskset.config.task)


async def play_verifiers_task(row: Prompt, endpoint: Any) -> str:
    """One rollout of the row's task by its taskset's program; verifiers' trace as JSON."""
    # verifiers' import (~10 s of CPU) and the taskset's load, once per engine, in a thread:
    # on the engine's event loop they would hold up every trajectory and the engine's steps
    task = await asyncio.to_thread(task_of, row)
    import verifiers.v1 as vf

    os.environ[KEY_VARIABLE] = endpoint.api_key
    agent = vf.Agent(
        vf.AgentConfig(
            model=endpoint.model,
            client=vf.EvalClientConfig(base_url=endpoint.base_url, api_key_var=KEY_VARIABLE),
            harness=vf.default_agent_harness(row.answer["taskset"]["id"]),
            runtime=vf.SubprocessConfig(),
        )
    )
    async with agent:
        trace = await agent.run(task.defer_scoring())
    if not trace.ok:
        error = trace.errors[-1] if trace.errors else None
        why = "no error recorded" if error is None else f"{error.type}: {error.message}"
        raise RuntimeError(f"verifiers' rollout failed: {why.strip().splitlines()[0][:300]}")
    return trace.model_dump_json()
