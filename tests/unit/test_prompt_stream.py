"""The prompt stream (groupflow/loop/prompt_stream.py) on its own: its checkpoint state.

Chunks are "generated" by a stand-in for the pipeline that samples every chunk at the
learner's current version and scores it with a reward drawn from the prompt's text.
"""

from __future__ import annotations

import hashlib
from itertools import islice

import pytest

from groupflow.core.records import Response, SampledGroup, ScoredGroup, Verdict
from groupflow.loop.prompt_stream import PromptStream, StreamState
from groupflow.reward_workers.tasks import make_task
from groupflow.run.job_config import build_config

GROUP_SIZE = 4


def stream_config(staleness: int, dynamic: bool):
    return build_config(
        {},
        [
            "trainer.steps=12",
            "rollout.prompts_per_step=6",
            f"rollout.group_size={GROUP_SIZE}",
            f"trainer.max_staleness={staleness}",
            f"algorithm.dynamic_sampling={str(dynamic).lower()}",
        ],
    )


def new_stream(cfg) -> PromptStream:
    return PromptStream(cfg, make_task(cfg.task.name, cfg.task.options), chunk_size=lambda: 2)


def reward(text: str, j: int) -> float:
    """Some groups flat (all 0 or all 1), others split, fixed by the prompt."""
    kind = hashlib.sha256(text.encode()).digest()[0] % 3
    return float(j % 2) if kind == 0 else float(kind == 1)


class Scorer:
    """The pipeline's part: sends every chunk drawn, samples it at `version`, scores it."""

    def __init__(self, stream: PromptStream):
        self.stream, self.version, self.sent = stream, 0, 0

    def send_waiting(self) -> None:
        for chunk in self.stream.waiting():
            chunk.handle, chunk.sent = f"call {chunk.id}", float(self.sent)
            self.sent += 1

    def __call__(self, chunk) -> list[ScoredGroup]:
        self.send_waiting()
        chunk.generated = chunk.sent + 1.0
        return [
            ScoredGroup(
                SampledGroup(p, [1], [Response([1], "", [-1.0])] * GROUP_SIZE, self.version),
                [Verdict(reward(p.text, j), "") for j in range(GROUP_SIZE)],
            )
            for p in chunk.prompts
        ]


def train(stream: PromptStream, first_step: int, steps: int, version: int) -> list[list[str]]:
    """The prompts each step takes, as a job would: a step, then the next steps' draws."""
    scorer, taken = Scorer(stream), []
    for step in range(first_step, first_step + steps):
        scorer.version = version
        groups = stream.take_step(step, version, scorer).groups
        taken.append([g.group.prompt.text for g in groups])
        scorer.send_waiting()  # drawn ahead for the next steps while this one learns
        version += 1
    return taken


@pytest.mark.parametrize("staleness", [0, 2])
@pytest.mark.parametrize("dynamic", [False, True])
def test_a_stream_restored_from_its_state_goes_on_with_the_same_prompts(staleness, dynamic):
    """Steps 1-4, the state through a checkpoint's JSON (prompts drawn ahead for steps 5 and
    6 are not in it), then steps 5-8: the restored stream takes what the straight one does."""
    cfg = stream_config(staleness, dynamic)
    straight = new_stream(cfg)
    before = train(straight, 1, 4, version=0)
    state = straight.state_dict()
    after = train(straight, 5, 4, version=4)

    assert state.consumed >= 4 * 6
    saved = state.model_dump_json()
    restored = new_stream(cfg)
    restored.load_state_dict(StreamState.model_validate_json(saved))
    assert train(restored, 5, 4, version=4) == after
    # the steps trained the stream in its order, each prompt once: all of it, or with
    # dynamic sampling the informative prompts it found
    trained = [t for step in before + after for t in step]
    stream = [p.text for p in islice(straight.task.train_prompts(cfg.trainer.seed), 400)]
    if dynamic:
        assert all(0 < len(step) <= 6 for step in before + after)
        rest = iter(stream)
        assert all(text in rest for text in trained)  # a subsequence of the stream
    else:
        assert trained == stream[: 8 * 6]


def test_a_state_goes_on_at_its_position_after_a_stream_that_went_further():
    """A rebuild loads an older state into a stream that already went past it."""
    cfg = stream_config(1, False)
    stream = new_stream(cfg)
    train(stream, 1, 2, version=0)
    state = stream.state_dict()
    after = train(stream, 3, 3, version=2)
    stream.abandon()
    stream.load_state_dict(state)
    assert train(stream, 3, 3, version=2) == after
    assert stream.state_dict() == StreamState(consumed=state.consumed + 3 * 6)


@pytest.mark.parametrize("ahead", [1, 3])
def test_groups_newer_than_the_learner_are_dropped_like_stale_ones(ahead):
    """After the learner is rebuilt from a checkpoint, an engine may still hold later weights
    than the learner: what it samples is dropped and counted, never trained on."""
    cfg = stream_config(2, False)
    stream = new_stream(cfg)
    scorer = Scorer(stream)
    scorer.version = 5 + ahead  # every group sampled by weights the learner does not hold
    with pytest.raises(RuntimeError, match="groups in a row"):
        stream.take_step(1, 5, scorer)
    fresh = new_stream(cfg)
    scorer = Scorer(fresh)
    scorer.version = 5
    taken = fresh.take_step(1, 5, scorer)
    assert taken.dropped_stale == 0 and len(taken.groups) == cfg.rollout.prompts_per_step
