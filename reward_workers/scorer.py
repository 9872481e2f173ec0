"""Scores sampled groups with a task's verifier; used by each reward worker."""

from __future__ import annotations

from groupflow.records import SampledGroup, ScoredGroup
from reward_workers.tasks import make_task


class Scorer:
    def __init__(
        self,
        task_name: str,
        task_options: dict | None = None,
        plugin: str | None = None,
        timeout_s: float = 30.0,
    ):
        if plugin is not None:
            raise ValueError("reward.verifier: plugins are not supported yet")
        self.task = make_task(task_name, task_options)
        self.timeout_s = timeout_s
        self.errors = 0
        self.timeouts = 0

    def score_group(self, group: SampledGroup) -> ScoredGroup:
        verdicts = [self.task.verify(group.prompt, r.text) for r in group.responses]
        return ScoredGroup(group=group, verdicts=verdicts)
