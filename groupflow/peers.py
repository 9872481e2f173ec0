"""What the job loop needs of its four peers and of the runtime that waits on them.

groupflow.actors implements these on Ray (a handle is an `ObjectRef` there); the unit tests of
the job loop implement them with in-process fakes on a virtual clock. A handle is opaque to the
job loop: it only passes handles back to `Futures`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from groupflow.records import Prompt, SampledGroup, ScoredGroup, TrainSequence

Handle = Hashable


class Futures(Protocol):
    def wait_any(self, handles: Sequence[Handle]) -> list[Handle]:
        """Block until at least one of `handles` is ready; returns the ready ones."""

    def get(self, handles: Sequence[Handle]) -> list[Any]:
        """The values of `handles` (blocking until ready; a remote error is raised here)."""


@dataclass
class GeneratedChunk:
    """Groups one engine sampled for one rollout, handed on as soon as they are done."""

    rollout_id: int
    groups: list[SampledGroup]


class Generation(Protocol):
    """The engines (groupflow.actors.generator.GeneratorPool)."""

    num_engines: int

    def submit(self, prompts: list[Prompt], rollout_id: int) -> list[Handle]:
        """Send the prompts in chunks to the engines; a handle per chunk."""

    def in_flight(self) -> list[Handle]:
        """Handles of the chunks submitted and not yet taken."""

    def take(self, ready: Sequence[Handle]) -> list[GeneratedChunk]:
        """The finished chunks among `ready` (handles of other peers are ignored)."""

    def queued_prompts(self) -> int:
        """Prompts sent to the engines and not yet taken."""

    def greedy(self, prompts: list[Prompt], max_tokens: int) -> list[str]:
        """One greedy completion per prompt, in order (blocking)."""

    def shutdown(self) -> None: ...


class Scoring(Protocol):
    """The reward workers (groupflow.actors.reward.RewardPool)."""

    num_workers: int
    errors: int
    timeouts: int

    def submit(self, groups: list[SampledGroup], rollout_id: int) -> None:
        """Start scoring the groups."""

    def drain(self, rollout_id: int) -> list[ScoredGroup]:
        """Block until every group submitted for `rollout_id` is scored; returns them."""

    def pending_groups(self) -> int:
        """Groups submitted and not yet drained."""

    def shutdown(self) -> None: ...


class Learner(Protocol):
    """The learner ranks (groupflow.actors.learner.LearnerGroup)."""

    num_ranks: int

    def async_train_step(self, sequences: list[TrainSequence]) -> list[Handle]:
        """Start one training step on every rank; a handle per rank's result."""

    def save_pretrained(self, path: str) -> None: ...

    def shutdown(self) -> None: ...


class WeightSync(Protocol):
    """Learner to engines (groupflow.actors.transport)."""

    def async_sync(self, version: int) -> list[Handle]:
        """Start making every engine serve the learner's parameters as `version`; the
        engines load them after the chunks already queued on them."""
