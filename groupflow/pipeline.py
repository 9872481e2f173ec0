"""The traffic between the job's peers while the job loop waits, in its one wait.

Whatever the loop waits on (`wait_for`, `scored`), every chunk that finishes generating goes to
the reward pool at once and every engine with room takes the prompt stream's next chunk, so
generation and scoring overlap learning. The engines hold at most CHUNKS_PER_ENGINE chunks
each (actors/generator.py) and the rest wait in the stream, so a weight load sent to an engine
runs after at most that many: the weights reach each engine between its chunks, and no engine
waits for another's load (`sync_engines` waits for the learner's side only; the engines' loads
are followed here).

An engine that dies is replaced by the generator pool; the replacement is sent the current
weights as soon as the learner is between steps (`version` is set), and the pool then sends
the chunks the dead engine held again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from groupflow.peers import Chunk, Futures, Generation, Handle, PeerDied, Scoring, WeightSync
from groupflow.prompt_stream import PromptStream
from groupflow.records import ScoredGroup
from groupflow.recovery import LearnerLost, RestartBudget
from groupflow.timing import stage_timer


class Pipeline:
    def __init__(
        self,
        stream: PromptStream,
        generators: Generation,
        rewards: Scoring,
        transport: WeightSync,
        futures: Futures,
        restarts: RestartBudget,
    ):
        self.stream = stream
        self.generators = generators
        self.rewards = rewards
        self.transport = transport
        self.futures = futures
        self.restarts = restarts
        # The learner's version while it is between steps, when its parameters are that
        # version and can be sent to an engine; None while it trains or is rebuilt.
        self.version: int | None = 0
        self._engine_loads: list[Handle] = []  # weight loads the engines have not finished

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
            return self.rewards.drain(chunk.id)

    def feed(self) -> None:
        """Send the stream's waiting chunks to the engines with room (replaced engines get
        the weights and lost chunks are sent again first, if the learner can send them)."""
        if self.version is not None:
            self.heal()
        for chunk in self.stream.waiting()[: self.generators.room()]:
            self.generators.send(chunk)

    def heal(self) -> None:
        """Send replaced engines the current weights, and the chunks the dead ones held."""
        if self.generators.needs_weights():
            self.sync_engines(wait_for_engines=True, only_awaiting=True)
        else:
            self.generators.resend_lost()

    def sync_engines(self, wait_for_engines: bool, only_awaiting: bool = False) -> None:
        """Send every engine (or, `only_awaiting`, those that await the weights) `version`
        and wait for the learner's side; each engine loads it after the chunks it holds, on
        its own (or waited for too, with `wait_for_engines`). A dead engine met on the way is
        replaced and the sync sent again."""
        while True:
            replaced = self.restarts.engines
            engines = self.generators.awaiting_weights() if only_awaiting else None
            handles = self.transport.async_sync(self.version, engines)
            self.generators.weights_sent()
            if wait_for_engines:
                wait = handles.learner + handles.engines
            else:  # an engine that dies loading is noticed in `_pump`
                wait = handles.learner
                self._engine_loads.extend(handles.engines)
            try:
                self.wait_for(wait)
                return
            except PeerDied as err:
                self.generators.replace_dead()
                if self.restarts.engines == replaced:  # no engine died: a rank did
                    raise LearnerLost(f"a learner rank died in a weight sync: {err}") from err

    def abandon(self) -> None:
        """The learner is lost: draw and send nothing more, let the rollouts in flight finish
        and drop them. No weights are sent until `version` is set again."""
        self.version = None
        self.stream.stop_drawing()
        while self.generators.in_flight():
            self._stream_until(self.generators.in_flight())
        for chunk in self.stream.abandon():
            if chunk.generated is not None:
                self.rewards.drain(chunk.id)
        self.generators.drop_lost()

    def _stream_until(self, handles: Sequence[Handle]) -> Sequence[Handle]:
        waiting = set(handles)
        while waiting:
            waiting.difference_update(self._pump(waiting))
        return handles

    def _pump(self, waiting: set[Handle] | tuple) -> list[Handle]:
        """Wait for any of `waiting`, a chunk or an engine's weight load; hand finished chunks
        to the reward pool and send engines with room their next chunk. Returns the ready
        ones among `waiting` (raising where such a handle's peer failed)."""
        chunks = set(self.generators.in_flight())
        loads = set(self._engine_loads)
        ready = self.futures.wait_any(list(set(waiting) | chunks | loads))
        for chunk, groups in self.generators.take(ready):
            self.rewards.submit(groups, chunk.id)
        for load in (h for h in ready if h in loads):
            self._engine_loads.remove(load)
            try:
                self.futures.get([load])
            except PeerDied:  # its chunks are sent again once the replacement has the weights
                self.generators.replace_dead()
        # A peer that died fails its handle at once; the others may never finish (ranks
        # blocked in a collective with the dead one).
        self.futures.get([h for h in ready if h in waiting and h not in chunks | loads])
        self.feed()
        return [h for h in ready if h in waiting]
