"""The job's prompts: one seeded stream, drawn in chunks and trained in the order drawn.

A step takes the next `rollout.prompts_per_step` groups of the stream as soon as each is scored,
whichever step they were drawn for (`take_step`). Chunks are drawn up to a limit that the
staleness bound sets: with `trainer.max_staleness` = k, the prompts of the next k steps may be
drawn and generating while a step trains. A group drawn while the learner is at version v is
sampled by version v or later and trained by version v + k at the latest; a group older than k
(a refill's surplus at k = 0, or a chunk of an engine that failed to load) is dropped and
counted, never trained on. Dynamic sampling (DAPO) skips groups whose rewards are all equal and
draws new prompts for them, a whole chunk at a time, up to MAX_REFILLS steps' worth.

The stream's checkpoint state is its position: how many prompts the trained steps consumed.
Prompts drawn for later steps are drawn again by a resumed job, so it trains the same prompts
in the same order as a straight one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice

from pydantic import BaseModel, ConfigDict, Field

from groupflow.config import Config
from groupflow.core.peers import Chunk
from groupflow.core.records import ScoredGroup
from groupflow.loop.infra_failures import valid_rewards
from groupflow.reward_workers.tasks.base import Task

# Dynamic sampling looks at most this many steps' worth of extra groups per step (DAPO keeps
# drawing; a bound keeps a task that is all-solved or all-failed from stalling the job).
MAX_REFILLS = 3


class StreamState(BaseModel):
    """Where the prompt stream stands in a checkpoint."""

    model_config = ConfigDict(extra="forbid")

    consumed: int = Field(ge=0)  # prompts of the seeded stream used by the trained steps


@dataclass
class StepGroups:
    """What a step takes from the stream."""

    groups: list[ScoredGroup] = field(default_factory=list)
    dropped_stale: int = 0  # groups older than max_staleness, never trained on
    filtered: int = 0  # groups dynamic sampling skipped (all rewards equal)
    first_sent: float | None = None  # the span of the chunks its groups came from
    last_generated: float = 0.0

    @property
    def generation_s(self) -> float:
        return 0.0 if self.first_sent is None else self.last_generated - self.first_sent


class PromptStream:
    """The stream of `task`'s training prompts, cut into chunks of `chunk_size()` prompts."""

    def __init__(self, cfg: Config, task: Task, chunk_size: Callable[[], int]):
        self.cfg = cfg
        self.task = task
        self.chunk_size = chunk_size  # follows the engine count, which scaling changes
        self._prompts = task.train_prompts(cfg.trainer.seed)
        # Positions of the stream drawn so far, consumed so far (trained, skipped or dropped),
        # and the most that may be drawn now.
        self._drawn = self._consumed = self._limit = 0
        self._chunk_ids = 0
        self._chunks: deque[Chunk] = deque()  # drawn and not yet consumed, in stream order
        self._front: deque[ScoredGroup] = deque()  # scored groups of a consumed chunk
        self._refilling = False  # drawing prompts for skipped groups

    # ----- checkpoint state ---------------------------------------------------------------------
    def state_dict(self) -> StreamState:
        return StreamState(consumed=self._consumed)

    def load_state_dict(self, state: StreamState) -> None:
        """Go on at `state`'s position; chunks drawn so far are forgotten."""
        self._prompts = islice(self.task.train_prompts(self.cfg.trainer.seed), state.consumed, None)
        self._drawn = self._consumed = self._limit = state.consumed
        self._chunks.clear()
        self._front.clear()
        self._refilling = False

    # ----- a step's groups ----------------------------------------------------------------------
    def take_step(
        self, step: int, version: int, scored: Callable[[Chunk], list[ScoredGroup]]
    ) -> StepGroups:
        """The step's groups: the next ones of the stream, in order, each as soon as its
        chunk is scored (`scored` blocks until it is). Groups too old for the learner at
        `version` are dropped; with dynamic sampling, groups that teach nothing are skipped,
        each replaced by a new prompt, until MAX_REFILLS steps' worth were looked at (then the
        step trains on what it has, or on the first skipped groups if nothing)."""
        per_step, k = self.cfg.rollout.prompts_per_step, self.cfg.trainer.max_staleness
        dynamic = self.cfg.algorithm.dynamic_sampling
        budget = (1 + MAX_REFILLS) * per_step if dynamic else per_step
        taken, skipped, looked_at = StepGroups(), [], 0
        # What may still be drawn for later steps: the next k steps' prompts, but none for a
        # step after the last.
        ahead = min(k, self.cfg.trainer.steps - step) * per_step
        while (needed := min(per_step - len(taken.groups), budget - looked_at)) > 0:
            self._limit = self._consumed + needed + ahead
            group = self._next_group(taken, scored)
            # Newer than the learner: sampled by weights it no longer holds (it was rebuilt
            # from a checkpoint while the engine had loaded later ones).
            if not 0 <= version - group.group.policy_version <= k:
                taken.dropped_stale += 1
                if taken.dropped_stale > budget:
                    raise RuntimeError(
                        f"{taken.dropped_stale} groups in a row were sampled by other weights "
                        f"than the learner's last {k + 1} versions (trainer.max_staleness={k}): "
                        "the engines do not load the weights they are sent"
                    )
                continue
            looked_at += 1
            if dynamic and len(set(valid_rewards(group))) <= 1:  # failures masked
                taken.filtered += 1
                skipped.append(group)
                self._refilling = True
            else:
                taken.groups.append(group)
        if not taken.groups:
            taken.groups = skipped[:per_step]
        self._refilling = False
        self._limit = self._consumed + ahead
        return taken

    def _next_group(
        self, taken: StepGroups, scored: Callable[[Chunk], list[ScoredGroup]]
    ) -> ScoredGroup:
        if not self._front:
            self._draw()
            chunk = self._chunks[0]
            self._front.extend(scored(chunk))
            self._chunks.popleft()
            if taken.first_sent is None or chunk.sent < taken.first_sent:
                taken.first_sent = chunk.sent
            taken.last_generated = max(taken.last_generated, chunk.generated)
        self._consumed += 1
        return self._front.popleft()

    # ----- drawing ------------------------------------------------------------------------------
    def waiting(self) -> list[Chunk]:
        """The chunks drawn and not yet sent to an engine, in order, after drawing up to the
        limit."""
        self._draw()
        return [c for c in self._chunks if c.handle is None]

    def _draw(self) -> None:
        size = self.chunk_size()
        waiting = any(c.handle is None for c in self._chunks)
        # A short chunk only when no full one waits. A refill draws a whole chunk, so that a
        # task with many flat groups is refilled in few rounds of generation, not a round per
        # group; what the step then does not need goes to the next steps (at staleness 0 it
        # is too old by then, and dropped).
        while (count := min(size, self._limit - self._drawn)) > 0 and (
            count == size or not waiting
        ):
            if self._refilling:
                count = size
            self._chunks.append(
                Chunk(self._chunk_ids, self._drawn, list(islice(self._prompts, count)))
            )
            self._chunk_ids += 1
            self._drawn += count
            waiting = True

    def draw_ahead(self, prompts: int) -> None:
        """Allow at least the next `prompts` prompts to be drawn (the next step's, while a
        checkpoint is saved)."""
        self._limit = max(self._limit, self._consumed + prompts)

    def stop_drawing(self) -> None:
        """Draw nothing more, and forget the chunks not sent yet."""
        self._limit = self._drawn
        self._chunks = deque(c for c in self._chunks if c.handle is not None)

    def abandon(self) -> list[Chunk]:
        """Forget every chunk drawn (their rollouts are dropped); returns them."""
        chunks = list(self._chunks)
        self._chunks.clear()
        self._front.clear()
        return chunks
