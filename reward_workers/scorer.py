"""Scores sampled groups with a task's verifier or a reward plugin; used by each reward worker.

Scoring never raises for a single response: a verifier that fails yields a zero-reward
Verdict with error="error" or "timeout", and the worker reports the `errors` / `timeouts`
counters.
"""

from __future__ import annotations

import logging
from typing import Any

from groupflow.records import Prompt, SampledGroup, ScoredGroup, Verdict
from groupflow.reward_workers.log_once import LogOnce
from groupflow.reward_workers.plugins import load_plugin
from groupflow.reward_workers.tasks import make_task

logger = logging.getLogger(__name__)


class Scorer:
    def __init__(
        self,
        task_name: str,
        task_options: dict[str, Any] | None = None,
        plugin: str | None = None,
        timeout_s: float = 30.0,
    ):
        """plugin: 'module:function' or 'file.py:function', used instead of the task's
        verifier; timeout_s bounds each plugin call."""
        self.task = make_task(task_name, task_options)
        self.plugin = load_plugin(plugin, timeout_s) if plugin else None
        self.errors = 0
        self.timeouts = 0
        self._log = LogOnce(logger)

    def score_group(self, group: SampledGroup) -> ScoredGroup:
        verdicts = [self.score_response(group.prompt, r.text) for r in group.responses]
        return ScoredGroup(group=group, verdicts=verdicts)

    def score_response(self, prompt: Prompt, response: str) -> Verdict:
        if self.plugin is not None:
            verdict = self.plugin(prompt, response)
        else:
            verdict = self._verify(prompt, response)
        if verdict.error == "timeout":
            self.timeouts += 1
        elif verdict.error is not None:
            self.errors += 1
        return verdict

    def _verify(self, prompt: Prompt, response: str) -> Verdict:
        try:
            return self.task.verify(prompt, response)
        except Exception as err:  # a verifier bug must cost one sample, not the worker
            reason = f"{self.task.name} verifier raised {type(err).__name__}: {err}"
            self._log.warning(type(err).__name__, reason)
            return Verdict(0.0, reason[:300], error="error")
