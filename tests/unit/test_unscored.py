"""Never train on nothing (groupflow/loop/unscored.py): the rule, and the job loop that follows it
(over the fakes of tests/unit/job_loop_fakes.py on the virtual clock)."""

from __future__ import annotations

import random

import pytest

from groupflow.core.records import Prompt, SampledGroup, ScoredGroup, Verdict
from groupflow.loop.unscored import UnscoredError, UnscoredSteps, unscored_reason
from tests.unit import job_loop_fakes
from tests.unit.job_loop_fakes import (
    PROMPTS_PER_STEP,
    FakeLearner,
    run_job,
    step_prompts,
    trained_prompts,
)

TIMED_OUT = "reward worker timed out"


def scored(errors: list[str | None], reason: str = TIMED_OUT) -> ScoredGroup:
    group = SampledGroup(Prompt("0", "q", 1), [1], [], 0)
    return ScoredGroup(group, [Verdict(0.0, reason if e else "ok", e) for e in errors])


def random_step(rng: random.Random, unscored: bool) -> list[ScoredGroup]:
    groups = [
        scored([rng.choice(["timeout", "error"]) for _ in range(rng.randint(1, 6))])
        for _ in range(rng.randint(1, 5))
    ]
    if not unscored:  # one scored response anywhere makes the step trainable
        rng.choice(groups).verdicts[0] = Verdict(0.0, "wrong answer")
    return groups


def test_a_step_is_unscored_only_when_no_response_was_scored():
    rng = random.Random()
    for _ in range(200):
        assert unscored_reason(random_step(rng, unscored=True)) == TIMED_OUT
        assert unscored_reason(random_step(rng, unscored=False)) is None
    assert unscored_reason([]) is None
    mixed = [scored(["timeout"] * 3), scored(["error"], "scorer process died")]
    assert unscored_reason(mixed) == TIMED_OUT  # the commonest reason names the cause


def test_unscored_steps_stop_the_job_only_in_a_row():
    limit = random.randint(2, 6)
    rule, rng = UnscoredSteps(limit), random.Random()
    for _ in range(3):  # a scored step in between starts the count again
        for _ in range(limit - 1):
            assert not rule.trainable(random_step(rng, unscored=True))
        assert rule.trainable(random_step(rng, unscored=False))
    for _ in range(limit - 1):
        assert not rule.trainable(random_step(rng, unscored=True))
    with pytest.raises(UnscoredError, match=rf"reward.max_unscored_steps={limit}; {TIMED_OUT}"):
        rule.trainable(random_step(rng, unscored=True))


class TimingOutRewards(job_loop_fakes.FakeRewards):
    """Training prompts below `unscored_below` get timeout verdicts (held-out ones are
    scored, as a pool that comes back would)."""

    unscored_below = 0

    def submit(self, groups, chunk_id):
        super().submit(groups, chunk_id)
        if chunk_id >= 0:
            _, batch = self.batches[-1]  # the batch just submitted
            for sg in batch.value:
                if int(sg.group.prompt.uid) < self.unscored_below:
                    sg.verdicts = [Verdict(0.0, TIMED_OUT, "timeout")] * len(sg.verdicts)


@pytest.mark.parametrize("staleness", [0, 1])
def test_the_job_never_trains_on_an_unscored_step(monkeypatch, staleness):
    monkeypatch.setattr(job_loop_fakes, "FakeRewards", TimingOutRewards)
    monkeypatch.setattr(TimingOutRewards, "unscored_below", PROMPTS_PER_STEP)
    run = run_job(steps=3, staleness=staleness)
    trained = trained_prompts(run)
    assert len(trained) == 3
    assert all(min(prompts) >= PROMPTS_PER_STEP for prompts in trained)
    assert trained[0] == step_prompts(PROMPTS_PER_STEP)
    assert [r["step"] for r in run.records] == [1, 2, 3]


def test_a_job_whose_rewards_never_come_stops_without_training(monkeypatch):
    monkeypatch.setattr(job_loop_fakes, "FakeRewards", TimingOutRewards)
    monkeypatch.setattr(TimingOutRewards, "unscored_below", 10**9)
    with pytest.raises(UnscoredError, match="reward.max_unscored_steps=2"):
        run_job(steps=5, overrides=["reward.max_unscored_steps=2"])
    learners = []
    monkeypatch.setattr(
        job_loop_fakes,
        "FakeLearner",
        lambda *args: learners.append(FakeLearner(*args)) or learners[-1],
    )
    with pytest.raises(UnscoredError, match="max_unscored_steps=3"):  # the default
        run_job(steps=5)
    assert learners and learners[0].steps == []
