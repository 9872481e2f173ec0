"""Several tasks in one job (`task: [{name: math, weight: 3}, {name: code, weight: 1}]`):
prompts are drawn from the tasks by weight, and each prompt keeps its task's verifier.

The job config's task list becomes this task's options (groupflow/config/load.py), so every
process that builds the job's task by name (reward workers, scorer processes) builds the same
mixture. Each prompt carries its task's label (`Prompt.task`), which routes its verification
and splits the per-task metrics.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from groupflow.core.records import Prompt, Verdict
from groupflow.reward_workers.tasks.base import Task, demonstration_turns

ENTRY_KEYS = {"name", "options", "weight", "label", "max_tokens"}


@dataclass(frozen=True)
class MixtureEntry:
    label: str
    name: str
    options: dict[str, Any]
    weight: float
    max_tokens: int | None  # this task's response limit; None = rollout.sampling.max_tokens


def mixture_entries(tasks: Any) -> list[MixtureEntry]:
    """The task list of a mixture, checked; ValueError naming the entry otherwise."""
    from groupflow.reward_workers.tasks import TASKS, is_task

    if not isinstance(tasks, list) or not tasks:
        raise ValueError("a mixture needs a non-empty list of tasks")
    entries: list[MixtureEntry] = []
    for i, entry in enumerate(tasks):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise ValueError(f"entry {i}: expected {{name: ..., weight: ...}}")
        if unknown := set(entry) - ENTRY_KEYS:
            raise ValueError(f"entry {i}: unknown key {sorted(unknown)[0]!r}")
        name, label = entry["name"], entry.get("label", entry["name"])
        if not is_task(name) or name == MixtureTask.name:
            choices = sorted(set(TASKS) - {MixtureTask.name})
            raise ValueError(f"entry {i}: unknown task {name!r}; choose one of {choices}")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise ValueError(f"{label}: weight must be a number (got {weight!r})")
        if not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"{label}: weight must be positive and finite (got {weight!r})")
        options = entry.get("options") or {}
        if not isinstance(label, str) or not label or not isinstance(options, dict):
            raise ValueError(f"entry {i}: label must be text and options a mapping")
        if label in {e.label for e in entries}:
            raise ValueError(f"{label!r} appears twice (give each entry its own label)")
        max_tokens = entry.get("max_tokens")
        if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
            raise ValueError(f"{label}: max_tokens must be a positive integer (got {max_tokens!r})")
        entries.append(MixtureEntry(label, name, options, float(weight), max_tokens))
    return entries


class MixtureTask:
    name = "mixture"
    # the built-in model's warm start demonstrates each prompt as its own task does
    DEMONSTRATION_FORMAT = "each task's own"

    def __init__(self, tasks: list[dict[str, Any]]):
        from groupflow.reward_workers.tasks import make_task

        entries = mixture_entries(tasks)
        self.tasks: dict[str, Task] = {e.label: make_task(e.name, e.options) for e in entries}
        self.weights: dict[str, float] = {e.label: e.weight for e in entries}
        self.max_tokens: dict[str, int | None] = {e.label: e.max_tokens for e in entries}
        # The scorer's per-call deadline: the most generous member's.
        from groupflow.reward_workers.scorer import DEFAULT_VERIFY_TIMEOUT_S

        self.timeout_s = max(
            getattr(t, "timeout_s", DEFAULT_VERIFY_TIMEOUT_S) for t in self.tasks.values()
        )

    @property
    def labels(self) -> list[str]:
        return list(self.tasks)

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        streams = {
            label: task.train_prompts(seed + i)
            for i, (label, task) in enumerate(self.tasks.items())
        }
        rng = random.Random(seed)
        labels, weights = self.labels, list(self.weights.values())
        while True:
            label = rng.choices(labels, weights)[0]
            yield self._tagged(next(streams[label]), label)

    def eval_prompts(self, n: int) -> list[Prompt]:
        """Each task's held-out prompts, in proportion to its weight (at least one each)."""
        total = sum(self.weights.values())
        out = []
        for label, task in self.tasks.items():
            share = max(1, round(n * self.weights[label] / total))
            out += [self._tagged(p, label) for p in task.eval_prompts(share)]
        return out

    def verify(self, prompt: Prompt, response: str) -> Verdict:
        task = self.tasks.get(prompt.task)
        if task is None:
            return Verdict(0.0, f"no task {prompt.task!r} in this mixture", error="error")
        return task.verify(prompt, response)

    def demonstration_turns(self, prompt: Prompt) -> list[tuple[str, bool]]:
        # the member's own prompt: a task may read its uid (long_addition's holds the sum)
        own = replace(prompt, uid=prompt.uid.removeprefix(f"{prompt.task}/"))
        return demonstration_turns(self.tasks[prompt.task], own)

    def _tagged(self, prompt: Prompt, label: str) -> Prompt:
        # The uid stays unique across tasks: two tasks may number their prompts alike.
        uid = f"{label}/{prompt.uid}"
        return replace(prompt, uid=uid, task=label, max_tokens=self.max_tokens[label])

    def parse_answer(self, raw: Any) -> Any:
        raise ValueError("a mixture reads no answers itself: each of its tasks reads its own")
