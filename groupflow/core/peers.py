"""What the job loop needs of its four peers and of the runtime that waits on them.

groupflow.actors implements these on Ray (a handle is an `ObjectRef` there); the unit tests of
the job loop implement them with in-process fakes on a virtual clock. A handle is opaque to the
job loop: it only passes handles back to `Futures`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from groupflow.config.rollout import SamplingConfig
from groupflow.core.records import Prompt, SampledGroup, ScoredGroup, TrainSequence

Handle = Hashable


class PeerDied(RuntimeError):
    """The actor behind a handle died (killed, out of memory, its node lost): what `Futures`
    raises instead of the runtime's own error, so the job loop can replace it."""


class Futures(Protocol):
    def wait_any(self, handles: Sequence[Handle], timeout: float | None = None) -> list[Handle]:
        """Block until at least one of `handles` is ready, or `timeout` seconds passed;
        returns the ready ones (none at a timeout). With no handles, sleeps `timeout`."""

    def get(self, handles: Sequence[Handle]) -> list[Any]:
        """The values of `handles` (blocking until ready; a remote error is raised here,
        PeerDied where the actor died)."""


@dataclass(eq=False)
class Chunk:
    """Prompts of the stream, at positions [first, first + len(prompts)), sampled in one
    engine call and scored under its id: the one record of a chunk. The prompt stream
    (groupflow/loop/prompt_stream.py) draws it and consumes it in order; the generator pool places
    it, and sends it again on its own when its engine dies."""

    id: int
    first: int
    prompts: list[Prompt]
    handle: Handle | None = None  # the engine call generating it; None: not sent yet
    engine: int = -1  # the pool's slot for it
    actor: object = None  # the engine it was sent to (its slot may hold a replacement since)
    sent: float | None = None  # on the pool's clock
    generated: float | None = None  # when its groups were taken, to be handed on for scoring


@dataclass
class GenerationFigures:
    engines: int  # in the pool, retiring ones included
    idle_engine_s: float  # engine-seconds so far in which an engine held no chunk
    queued_prompts: int  # sent to the engines and not yet taken
    serving: int  # engines that take work now (loaded, not retiring, not dead)


# Chunks an engine holds at most, generating side by side (their groups batched continuously
# with each other): when one ends, the other keeps the engine busy while the driver sends the
# next. The rest wait in the prompt stream, for whichever engine frees up first.
CHUNKS_PER_ENGINE = 2


def chunk_size(num_prompts: int, num_engines: int) -> int:
    """A step's prompts in CHUNKS_PER_ENGINE chunks per engine: the first chunks are scored
    while the second generate."""
    return max(1, num_prompts // (CHUNKS_PER_ENGINE * num_engines))


class Generation(Protocol):
    """The engines (groupflow.actors.generator.GeneratorPool); scaled through
    groupflow.core.scaling_protocol.ScalablePool."""

    def figures(self) -> GenerationFigures: ...

    def send(self, chunks: Sequence[Chunk], version: int) -> None:
        """Send `chunks`, in order, each to the engine with the least work, as many as the
        engines with the current weights (policy `version`, the pipeline's) have room for
        (each holds a few chunks at most, so that a weight load waits behind little work);
        sets each sent chunk's handle."""

    def in_flight(self) -> list[Handle]:
        """What the job loop waits on for this peer: the chunks submitted and not yet taken,
        and the starts of dead engines' replacements (so that `take` admits one the moment
        it is up)."""

    def take(self, ready: Sequence[Handle]) -> list[tuple[Chunk, list[SampledGroup]]]:
        """The finished chunks among `ready` (handles of other peers are ignored), with
        their groups; replacements among `ready` that are up are admitted. A chunk whose
        engine died is not among them: the engine is `lost` and the chunk kept, to be sent
        again to an engine with the current weights."""

    def lost(self, engine: Any, cause: str) -> None:
        """`engine` died: one restart charged to the job's budget however many of its calls
        fail; it takes no work and a replacement is asked for."""

    def engines_to_sync(self, only_awaiting: bool) -> list:
        """The engines a sync goes to: every engine not known to be dead, or `only_awaiting`
        those that wait for the current weights before they take work (replacements and new
        engines)."""

    def weights_sent(self) -> None:
        """After the current weights were sent to the engines (every engine that awaited
        them): the engines that awaited them take work."""

    def drop_lost(self) -> None:
        """Forget the lost chunks (their rollouts were abandoned)."""

    def complete(
        self, prompts: list[Prompt], n: int, sampling: SamplingConfig, greedy: bool, version: int
    ) -> list[SampledGroup] | None:
        """A group per prompt, in order (blocking), by policy `version`: one greedy answer,
        or n sampled ones; None where no engine takes work or one died answering (it is
        `lost`: ask again)."""

    def shutdown(self) -> None: ...


class Scoring(Protocol):
    """The reward workers (groupflow.actors.reward.RewardPool); scaled through
    groupflow.core.scaling_protocol.ScalablePool."""

    num_workers: int
    errors: int
    timeouts: int

    def submit(self, groups: list[SampledGroup], chunk_id: int) -> None:
        """Start scoring the groups."""

    def in_flight(self) -> list[Handle]:
        """Handles of the batches being scored, and of dead workers' replacements starting
        (as Generation's)."""

    def seconds_to_deadline(self) -> float | None:
        """Until the first batch in flight is overdue (a hung or lost worker), so that a wait
        wakes for it; None when nothing is in flight."""

    def take(self, ready: Sequence[Handle]) -> list[tuple[int, list[ScoredGroup]]]:
        """The scored groups of the batches among `ready` and of the overdue ones (scored 0),
        each with its chunk id (handles of other peers are ignored). A batch whose worker
        died is sent again instead, up to `reward.max_retries` times."""

    def scoring(self, chunk_id: int) -> bool:
        """Groups submitted for `chunk_id` are still being scored."""

    def pending_groups(self) -> int:
        """Groups submitted and not yet scored."""

    def shutdown(self) -> None: ...


class Learner(Protocol):
    """The learner ranks (groupflow.actors.learner.LearnerGroup)."""

    num_ranks: int

    def async_train_step(
        self, sequences: list[TrainSequence], lr: float | None = None
    ) -> list[Handle]:
        """Start one training step on every rank at learning rate `lr` (None: the current
        one); a handle per rank's result."""

    def save_pretrained(self, path: str) -> None: ...

    def restart(self) -> None:
        """Replace every rank with a new one on the base model (blocking)."""

    def async_save_checkpoint(self, directory: str) -> list[Handle]:
        """Start writing every rank's model and optimizer shards under `directory`."""

    def load_checkpoint(self, directory: str) -> None:
        """Load what async_save_checkpoint wrote (blocking)."""

    def shutdown(self) -> None: ...


@dataclass
class SyncHandles:
    learner: list[Handle]  # ready when the learner's side is done: it may train again
    engines: list[Handle]  # ready when each engine serves the new version
    receivers: list  # the engine of each of `engines`

    def handles(self) -> list[Handle]:
        return self.learner + self.engines


class WeightSync(Protocol):
    """Learner to engines (groupflow.actors.transport)."""

    def async_sync(self, version: int, engines: list) -> SyncHandles:
        """Start making `engines` serve the learner's parameters as `version`; they load them
        after the chunks already queued on them."""

    def check_load(self, load: Handle, loaded: Any) -> bool:
        """Check a finished engine load (`load`, one of SyncHandles.engines; `loaded`, its
        value) against what the learner sent: True where it matched, False where there was
        nothing to check (a load abandoned with the learner's broken stream); a mismatch
        raises (groupflow.core.weight_format.WeightSyncMismatch)."""

    def forget(self, load: Handle) -> None:
        """A load that will never be checked (its engine died)."""

    def probe_figures(self) -> dict[str, float]:
        """The sync probe's agreement over the loads checked since the last call (the step
        record's sync_probe_* keys; none where no load was probed)."""
