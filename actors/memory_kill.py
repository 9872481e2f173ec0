"""An actor that Ray's memory monitor killed, said in one line.

Ray reports such a death as a paragraph of about 1,300 characters (which worker, the node's
memory, how to turn the monitor off) that never names the job's setting behind the memory.
`memory_kill_line` reads what matters out of it: which actor, what it held resident when it was
killed, the node's memory, and the setting that lowers what that actor holds.
"""

from __future__ import annotations

import re

import ray

# Ray's actor class name -> (what the actor is, in the job's words; the settings to lower)
ACTOR_SETTINGS: dict[str, tuple[str, str]] = {
    "LearnerRankActor": ("a learner rank", "learner.micro_batch_tokens or learner.memory_gib"),
    "Generator": ("an engine", "rollout.kv_cache_gib or rollout.max_model_len"),
    "RewardWorker": ("a reward worker", "reward.num_workers"),
    "ToolWorker": ("a tool worker", "agent.tool_workers"),
}

# What Ray 2.x writes, in a task's OutOfMemoryError and in a dead actor's exit detail.
_MARKS = ("running low on memory", "NODE_OUT_OF_MEMORY", "killed due to memory pressure")
_ACTOR_MEMORY = re.compile(r"memory used=([\d.]+)\s*GB")
_NODE_MEMORY = re.compile(
    r"Memory on the node \(IP: ([^,)]+)[^)]*\).*?\bwas ([\d.]+)\s*GB(?: used)?\s*/\s*([\d.]+)\s*GB",
    re.S,
)
_CLASS = re.compile(r"(?:class_name: |task name=|name=)([A-Za-z_][\w]*)")


def killed_for_memory(err: BaseException) -> bool:
    """Whether `err` is Ray's report of a worker its memory monitor killed."""
    if isinstance(err, ray.exceptions.OutOfMemoryError):
        return True
    return isinstance(err, ray.exceptions.RayActorError) and any(m in str(err) for m in _MARKS)


def memory_kill_line(err: BaseException) -> str:
    """One line for Ray's report `err` of an actor killed for memory (killed_for_memory)."""
    text = str(err)
    name = next((m for m in _CLASS.findall(text) if m in ACTOR_SETTINGS), None)
    what, setting = ACTOR_SETTINGS.get(name, ("an actor", "the memory of the job's actors"))
    held = _ACTOR_MEMORY.search(text)
    node = _NODE_MEMORY.search(text)
    parts = [f"{what} ({name or 'unknown'}) was killed by Ray's memory monitor"]
    parts.append(f"holding {held.group(1)} GB resident" if held else "its memory unknown")
    if node:
        ip, used, limit = node.groups()
        parts.append(f"node {ip} at {used} GB of {limit} GB")
    return ", ".join(parts) + f"; lower {setting}"
