"""The traffic between the job's peers, and the job loop's one wait.

The loop waits in one place, `_pump`, on every peer at once: on what it waits for
(`wait_for`, `scored`, `scores_of`), the chunks generating, the batches scoring (waking when
the first is overdue) and the engines' weight loads. Whatever it waits on, every chunk that
finishes generating goes to the reward pool at once, every engine with room takes the prompt
stream's next chunk and scored groups are kept for their chunk, so generation and scoring
overlap learning and each other. The engines hold at most CHUNKS_PER_ENGINE chunks each
(groupflow/core/peers.py) and the rest wait in the stream; a chunk sent after a weight load starts
once the load is done, and a load stops an engine's running requests only for itself (partial
rollouts) or waits for them (rollout/engine.py). No engine waits for another's load
(`sync_engines` waits for the learner's side only; the engines' loads are followed here).

An engine that dies is lost to the generator pool, which sends the chunks it held to the
engines still there and asks for a replacement; the loop waits on the replacement's start with
everything else, and sends it the current weights as soon as it is up and the learner is
between steps. Nothing here waits on one actor alone: a replacement that has no node to go to
holds up nothing but the work that needs it.

The pipeline owns the policy version, the job's one count of it: the learner's updates move
it on (`learning`), a rebuild from a checkpoint sets it back (`restored`), and every chunk and
held-out answer it has the engines sample carries it.

Every HEARTBEAT_S of waiting, and as soon as the engines serving change, the loop calls
`heartbeat` (the job publishes its live status and Prometheus series there, and says what a
long wait is waiting for), so that a stalled step is seen while it stalls.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from groupflow.core.peers import Chunk, Futures, Generation, Handle, PeerDied, Scoring, WeightSync
from groupflow.core.records import ScoredGroup
from groupflow.core.recovery import LearnerLost
from groupflow.core.timing import stage_timer
from groupflow.loop.prompt_stream import PromptStream

HEARTBEAT_S = 5.0


class Pipeline:
    def __init__(
        self,
        stream: PromptStream,
        generators: Generation,
        rewards: Scoring,
        transport: WeightSync,
        futures: Futures,
        heartbeat: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.stream = stream
        self.generators = generators
        self.rewards = rewards
        self.transport = transport
        self.futures = futures
        self.version = 0  # the policy version: updates of the learner that landed
        # The learner is between steps: its parameters are `version` and can be sent to an
        # engine (not while it trains or is rebuilt).
        self._sendable = True
        self._engine_loads: dict[Handle, Any] = {}  # loads not finished -> their engine
        self.heartbeat = heartbeat
        self._clock = clock
        self._beat_at = clock()
        self._serving_at_beat = generators.figures().serving  # engines serving when last said
        self._loads_verified = 0  # engine loads checked against the learner's checksums
        self._scored: dict[int, list[ScoredGroup]] = defaultdict(list)  # by rollout id

    @contextmanager
    def learning(self) -> Iterator[None]:
        """Around one learner update: no weights are sent while it runs, and the policy
        version moves on when it lands. An update that raises (a lost rank) leaves the
        version as it was and sends nothing until the learner is `restored`."""
        self._sendable = False
        yield
        self.version += 1
        self._sendable = True

    def restored(self, version: int) -> None:
        """The learner was loaded at `version` (a checkpoint's): every engine is sent it, and
        waited for."""
        self.version = version
        self._sendable = True
        self.sync_engines(wait_for_engines=True)

    def step_figures(self) -> dict[str, float]:
        """The pipeline's part of a step record: the engine loads checked against the
        learner's checksums since the last record, and their sync probe's agreement."""
        verified, self._loads_verified = self._loads_verified, 0
        return {"weight_sync_verified": verified} | self.transport.probe_figures()

    def wait_for(self, handles: Sequence[Handle]) -> list[Any]:
        """The values of `handles` (blocking), the traffic flowing meanwhile."""
        return self.futures.get(self._stream_until(handles))

    def scored(self, chunk: Chunk, times: dict[str, float]) -> list[ScoredGroup]:
        """The chunk's scored groups (blocking). Waiting for its generation is the stage
        `wait_rollout` (the learner idle for want of samples), then for its scores `reward`."""
        self.feed()
        with stage_timer("wait_rollout", times):
            while chunk.generated is None:  # a chunk lost with its engine is sent again
                self._pump(())
        with stage_timer("reward", times):
            return self.scores_of(chunk.id)

    def scores_of(self, chunk_id: int) -> list[ScoredGroup]:
        """The groups submitted for scoring under `chunk_id`, scored (blocking)."""
        while self.rewards.scoring(chunk_id):
            self._pump(())
        return self._scored.pop(chunk_id, [])

    def feed(self) -> None:
        """Send the stream's waiting chunks to the engines with room (new engines get the
        weights first, if the learner can send them)."""
        if self._sendable:
            self.heal()
        self.generators.send(self.stream.waiting(), self.version)

    def draw_ahead(self, prompts: int) -> None:
        """Let the stream's next `prompts` prompts be drawn, and send them (the next step's,
        generating while a checkpoint is saved)."""
        self.stream.draw_ahead(prompts)
        self.feed()

    def heal(self) -> None:
        """Send the engines that came up (replacements, new engines) the current weights."""
        if self.generators.engines_to_sync(only_awaiting=True):
            self.sync_engines(wait_for_engines=True, only_awaiting=True)

    def wait_for_engines(self) -> None:
        """Until an engine takes work (after every engine was lost: until a replacement is
        up and holds the current weights)."""
        self.heal()
        while not self.generators.figures().serving:
            self._pump(())

    def sync_engines(self, wait_for_engines: bool, only_awaiting: bool = False) -> None:
        """Send every engine (or, `only_awaiting`, those that await the weights) `version`
        and wait for the learner's side; each engine loads it after the chunks it holds, on
        its own (or waited for too, with `wait_for_engines`). The loads are followed in the
        one wait: an engine that dies loading is lost to the pool, and its replacement gets
        the weights when it is up."""
        gen = self.generators
        handles = self.transport.async_sync(self.version, gen.engines_to_sync(only_awaiting))
        gen.weights_sent()
        self._engine_loads.update(zip(handles.engines, handles.receivers, strict=True))
        try:
            self.wait_for(handles.learner)
        except PeerDied as err:
            raise LearnerLost(f"a learner rank died in a weight sync: {err}") from err
        while wait_for_engines and any(h in self._engine_loads for h in handles.engines):
            self._pump(())

    def abandon(self) -> None:
        """The learner is lost: draw and send nothing more, let the rollouts in flight finish
        and drop them. No weights are sent until the learner is `restored`."""
        self._sendable = False
        self.stream.stop_drawing()
        while self.generators.figures().queued_prompts or self.rewards.pending_groups():
            self._pump(())
        self.stream.abandon()
        self._scored.clear()
        self.generators.drop_lost()

    def _stream_until(self, handles: Sequence[Handle]) -> Sequence[Handle]:
        waiting = set(handles)
        while waiting:
            waiting.difference_update(self._pump(waiting))
        return handles

    def _beat_in(self) -> float:
        """Seconds to the next heartbeat; 0 once it is due, or within a microsecond of it: a
        wait of that remainder may leave a clock short of it in floating point."""
        left = HEARTBEAT_S - (self._clock() - self._beat_at)
        return left if left > 1e-6 else 0.0

    def _pump(self, waiting: set[Handle] | tuple) -> list[Handle]:
        """The loop's one wait: for any of `waiting`, a chunk, a batch of scores, an engine's
        weight load or a replacement's start. Hands finished chunks to the reward pool, keeps
        scored groups, sends engines with room their next chunk. Returns the ready ones among
        `waiting` (raising where such a handle's peer failed)."""
        chunks = set(self.generators.in_flight())
        batches = set(self.rewards.in_flight())
        loads = set(self._engine_loads)
        timeout = self._beat_in()
        if (deadline := self.rewards.seconds_to_deadline()) is not None:
            timeout = min(timeout, deadline)
        # Nothing in flight (a replacement to be asked for again): the heartbeat's sleep.
        handles = list(set(waiting) | chunks | batches | loads)
        ready = self.futures.wait_any(handles, max(0.0, timeout))
        for chunk, groups in self.generators.take(ready):
            self.rewards.submit(groups, chunk.id)
        for chunk_id, groups in self.rewards.take(ready):
            self._scored[chunk_id] += groups
        for load in (h for h in ready if h in loads):
            engine = self._engine_loads.pop(load)
            try:
                (loaded,) = self.futures.get([load])
            except PeerDied as err:  # its chunks go to the other engines
                self.transport.forget(load)
                self.generators.lost(engine, str(err))
                continue
            self._loads_verified += self.transport.check_load(load, loaded)
        # A peer that died fails its handle at once; the others may never finish (ranks
        # blocked in a collective with the dead one).
        self.futures.get([h for h in ready if h in waiting and h not in chunks | batches | loads])
        # An engine lost or admitted is published at once (`groupflow status`, the live
        # series), not at the next heartbeat: the status read after the driver's line about it
        # shows it too.
        serving = self.generators.figures().serving
        if serving != self._serving_at_beat or self._beat_in() == 0.0:
            self._beat_at, self._serving_at_beat = self._clock(), serving
            self.heartbeat()
        self.feed()
        return [h for h in ready if h in waiting]
