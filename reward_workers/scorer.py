"""Scores responses with a task's verifier or a reward plugin; used by each reward worker.

A verifier reads a response's prompt (its text, answer and task label) and text, nothing else:
a reward worker receives those (`response_items`) and returns a Verdict for each, which the
pool puts back with the groups it kept (`scored_groups`); token ids and log-probs never travel
to a worker and back.

Every verifier and plugin call runs in a scorer process that is killed at its deadline
(reward_workers/verifier_pool.py). Scoring never raises for a single response: a verifier
that fails yields a zero-reward Verdict with error="error" or "timeout", and the worker
reports the `errors` / `timeouts` counters.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from groupflow.core.records import Prompt, SampledGroup, ScoredGroup, Verdict
from groupflow.reward_workers import sandbox
from groupflow.reward_workers.log_once import LogOnce
from groupflow.reward_workers.tasks import make_task
from groupflow.reward_workers.tasks.options import check_positive_seconds
from groupflow.reward_workers.verifier_pool import VerifierPool, VerifierSpec

logger = logging.getLogger(__name__)

# Tasks without a timeout option of their own (arithmetic, countdown, knights_and_knaves)
# are pure-Python checks of bounded input: this is generous.
DEFAULT_VERIFY_TIMEOUT_S = 5.0

# What a verifier reads of one response: its prompt and the text its answer can occupy.
ResponseItem = tuple[Prompt, str]


def response_items(groups: list[SampledGroup]) -> list[ResponseItem]:
    """Every response of the groups, in order, as a verifier reads it: a trajectory's final
    turn (Response.answer_text), so that no observation and no earlier turn can answer."""
    return [(g.prompt, r.answer_text) for g in groups for r in g.responses]


def scored_groups(groups: list[SampledGroup], verdicts: list[Verdict]) -> list[ScoredGroup]:
    """The groups with their verdicts, which come in `response_items` order."""
    expected = sum(len(g.responses) for g in groups)
    if len(verdicts) != expected:
        raise ValueError(f"{len(verdicts)} verdicts for {expected} responses")
    found = iter(verdicts)
    return [
        ScoredGroup(group=g, verdicts=[_unless_failed(r, next(found)) for r in g.responses])
        for g in groups
    ]


def _unless_failed(response, verdict: Verdict) -> Verdict:
    """A trajectory its environment failed (or a tool worker under it, or its deadline while
    the environment held it) scores 0 with the error "environment", whatever its text would:
    the job masks it (groupflow/loop/infra_failures.py)."""
    if response.end_reason != "environment_error" and response.infra_failure is None:
        return verdict
    why = response.error or response.infra_failure
    return Verdict(0.0, f"the environment failed: {why}", error="environment")


class Scorer:
    def __init__(
        self,
        task_name: str,
        task_options: dict[str, Any] | None = None,
        plugin: str | None = None,
        timeout_s: float = 30.0,
        processes: int = 1,
    ):
        """plugin: 'module:function' or 'file.py:function', used instead of the task's
        verifier; timeout_s bounds each plugin call; processes: scorer processes (calls in
        flight at once)."""
        check_positive_seconds("reward", "timeout", timeout_s, maximum=86_400.0)
        self.task = make_task(task_name, task_options)
        call_timeout = (
            timeout_s if plugin else getattr(self.task, "timeout_s", DEFAULT_VERIFY_TIMEOUT_S)
        )
        spec = VerifierSpec(task_name, task_options, plugin, sandbox.probed_platform())
        self.pool = VerifierPool(spec, processes, call_timeout)
        self.errors = 0
        self.timeouts = 0
        self._log = LogOnce(logger)

    def score_groups(self, groups: list[SampledGroup]) -> list[ScoredGroup]:
        """All responses of all groups, in this process (no reward worker in between)."""
        return scored_groups(groups, list(self.score_stream(response_items(groups))))

    def score_stream(
        self, items: list[ResponseItem], budget_s: float | None = None
    ) -> Iterator[Verdict]:
        """Verdicts in input order as they come, several in flight at once; with budget_s,
        all of them within that many seconds (plus a margin): calls still unstarted when it
        runs out are timeouts."""
        return self._count(self.pool.verify_all(items, budget_s))

    def _count(self, verdicts: Iterator[Verdict]) -> Iterator[Verdict]:
        for verdict in verdicts:
            if verdict.error == "timeout":
                self.timeouts += 1
            elif verdict.error is not None:
                self.errors += 1
            if verdict.error is not None:
                self._log.warning(verdict.error, f"{self.task.name} scoring: {verdict.reason}")
            yield verdict

    def close(self) -> None:
        self.pool.close()
