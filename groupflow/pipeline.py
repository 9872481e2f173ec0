"""The traffic between the job's peers, and the job loop's one wait.

The loop waits in one place, `_pump`, on every peer at once: on what it waits for
(`wait_for`, `scored`, `scores_of`), the chunks generating, the batches scoring (waking when
the first is overdue) and the engines' weight loads. Whatever it waits on, every chunk that
finishes generating goes to the reward pool at once, every engine with room takes the prompt
stream's next chunk and scored groups are kept for their chunk, so generation and scoring
overlap learning and each other. The engines hold at most CHUNKS_PER_ENGINE chunks each
(actors/generator.py) and the rest wait in the stream; a chunk sent after a weight load starts
once the load is done, and a load stops an engine's running requests only for itself (partial
rollouts) or waits for them (rollout/engine.py). No engine waits for another's load
(`sync_engines` waits for the learner's side only; the engines' loads are followed here).

An engine that dies is replaced by the generator pool; the replacement is sent the current
weights as soon as the learner is between steps (`version` is set), and the pool then sends
the chunks the dead engine held again.
"""

from __future__ import annotations

from collections import defaultdict
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
        self.loads_verified = 0  # engine loads checked against the learner's checksums
        self._scored: dict[int, list[ScoredGroup]] = defaultdict(list)  # by rollout id

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
        """Send the stream's waiting chunks to the engines with room (replaced engines get
        the weights and lost chunks are sent again first, if the learner can send them)."""
        if self.version is not None:
            self.heal()
        self.generators.send(self.stream.waiting())

    def heal(self) -> None:
        """Send replaced engines the current weights (the pool then sends the chunks the
        dead ones held again)."""
        if self.generators.awaiting_weights():
            self.sync_engines(wait_for_engines=True, only_awaiting=True)

    def sync_engines(self, wait_for_engines: bool, only_awaiting: bool = False) -> None:
        """Send every engine (or, `only_awaiting`, those that await the weights) `version`
        and wait for the learner's side; each engine loads it after the chunks it holds, on
        its own (or waited for too, with `wait_for_engines`). A dead engine met on the way is
        replaced and the sync sent again."""
        while True:
            replaced = self.restarts.engines
            engines = self.generators.awaiting_weights() if only_awaiting else None
            handles = self.transport.async_sync(self.version, engines)
            self.generators.weights_sent(self.version)
            if wait_for_engines:
                wait = handles.learner + handles.engines
            else:  # an engine that dies loading is noticed in `_pump`
                wait = handles.learner
                self._engine_loads.extend(handles.engines)
            try:
                done = self.wait_for(wait)
            except PeerDied as err:
                for load in wait[len(handles.learner) :]:  # sent again below, or never
                    self.transport.forget(load)
                self.generators.replace_dead()
                if self.restarts.engines == replaced:  # no engine died: a rank did
                    raise LearnerLost(f"a learner rank died in a weight sync: {err}") from err
                continue
            learner_side = len(handles.learner)
            self._check_loads(wait[learner_side:], done[learner_side:])
            return

    def abandon(self) -> None:
        """The learner is lost: draw and send nothing more, let the rollouts in flight finish
        and drop them. No weights are sent until `version` is set again."""
        self.version = None
        self.stream.stop_drawing()
        while self.generators.in_flight() or self.rewards.in_flight():
            self._pump(())
        self.stream.abandon()
        self._scored.clear()
        self.generators.drop_lost()

    def _check_loads(self, loads: Sequence[Handle], loaded: Sequence) -> None:
        """Finished weight loads against the learner's checksums (a mismatch ends the job)."""
        for load, value in zip(loads, loaded, strict=True):
            self.loads_verified += self.transport.check_load(load, value)

    def _stream_until(self, handles: Sequence[Handle]) -> Sequence[Handle]:
        waiting = set(handles)
        while waiting:
            waiting.difference_update(self._pump(waiting))
        return handles

    def _pump(self, waiting: set[Handle] | tuple) -> list[Handle]:
        """The loop's one wait: for any of `waiting`, a chunk, a batch of scores or an
        engine's weight load. Hands finished chunks to the reward pool, keeps scored groups,
        sends engines with room their next chunk. Returns the ready ones among `waiting`
        (raising where such a handle's peer failed)."""
        chunks = set(self.generators.in_flight())
        batches = set(self.rewards.in_flight())
        loads = set(self._engine_loads)
        ready = self.futures.wait_any(
            list(set(waiting) | chunks | batches | loads), self.rewards.seconds_to_deadline()
        )
        for chunk, groups in self.generators.take(ready):
            self.rewards.submit(groups, chunk.id)
        for chunk_id, groups in self.rewards.take(ready):
            self._scored[chunk_id] += groups
        for load in (h for h in ready if h in loads):
            self._engine_loads.remove(load)
            try:
                loaded = self.futures.get([load])
            except PeerDied:  # its chunks are sent again once the replacement has the weights
                self.transport.forget(load)
                self.generators.replace_dead()
                continue
            self._check_loads([load], loaded)
        # A peer that died fails its handle at once; the others may never finish (ranks
        # blocked in a collective with the dead one).
        self.futures.get([h for h in ready if h in waiting and h not in chunks | batches | loads])
        self.feed()
        return [h for h in ready if h in waiting]
