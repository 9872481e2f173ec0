"""Failures not the model's are masked (groupflow/loop/infra_failures.py): out of their group's
statistics, the loss and its denominators, counted by reason; a wrong answer stays a 0."""

from __future__ import annotations

import logging
import random

import pytest

from groupflow.config import PRESETS
from groupflow.core.records import Prompt, Response, SampledGroup, ScoredGroup, Verdict
from groupflow.learner.advantages import ADVANTAGE_ESTIMATORS
from groupflow.loop.infra_failures import (
    STEPS_TO_STOP,
    InfraFailureError,
    InfraFailures,
    mask_failures,
    valid_rewards,
)
from groupflow.loop.sequences import group_advantages, train_sequences
from groupflow.run.job_config import build_config
from tests.unit import job_loop_fakes
from tests.unit.job_loop_fakes import GROUP_SIZE, PROMPTS_PER_STEP, FakeLearner, run_job

# (the response's infra_failure, its verdict's error): how each reason reaches the loop
FAILURES = {
    "environment_error": ("environment_error", "environment"),
    "environment_deadline": ("environment_deadline", "environment"),
    "tool_worker_lost": ("tool_worker_lost", "environment"),
    "verifier_error": (None, "error"),
    "verifier_timeout": (None, "timeout"),
}


def member(rng: random.Random, length: int | None = None) -> tuple[Response, Verdict]:
    n = length or rng.randint(1, 12)
    ids = [rng.randint(3, 90) for _ in range(n)]
    response = Response(ids, "x", [-rng.random() for _ in ids])
    return response, Verdict(rng.choice([0.0, 0.25, 1.0]), "judged")


def failed(rng: random.Random, reason: str) -> tuple[Response, Verdict]:
    infra, error = FAILURES[reason]
    ids = [rng.randint(3, 90) for _ in range(rng.randint(1, 12))]
    response = Response(ids, "x", [-0.5] * len(ids), infra_failure=infra)
    return response, Verdict(0.0, "failed", error)


def group(uid: int, members: list[tuple[Response, Verdict]]) -> ScoredGroup:
    responses, verdicts = [m[0] for m in members], [m[1] for m in members]
    return ScoredGroup(SampledGroup(Prompt(str(uid), "q", 1), [1, 2, uid], responses, 0), verdicts)


def step_with_and_without_failures(rng: random.Random):
    """The same valid members, once with failures among them (every group keeps two valid
    members at least) and once as if they had never been sampled."""
    with_failures, without = [], []
    for uid in range(rng.randint(1, 6)):
        valid = [member(rng) for _ in range(rng.randint(2, 6))]
        mixed = list(valid)
        for _ in range(rng.randint(0, 4)):
            mixed.insert(rng.randint(0, len(mixed)), failed(rng, rng.choice(list(FAILURES))))
        with_failures.append(group(uid, mixed))
        without.append(group(uid, valid))
    return with_failures, without


SETTINGS = [[f"algorithm.preset={p}"] for p in PRESETS] + [
    [f"algorithm.advantage={e}", f"algorithm.std={s}"]
    for e in ADVANTAGE_ESTIMATORS
    for s in ("unbiased", "biased", "none")
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(s))
def test_masked_failures_change_no_valid_members_advantage(settings):
    """In float64, exactly: the advantages and the training sequences (hence the loss and its
    denominators, whatever the preset) are those of a step that never had the failures."""
    rng = random.Random(len(settings) * 1000 + sum(map(ord, "".join(settings))))
    overlong = ["reward.overlong_penalty.buffer_tokens=4", "rollout.sampling.max_tokens=10"]
    for extra in ([], overlong):
        cfg = build_config({}, [*settings, *extra])
        for _ in range(30):
            with_failures, without = step_with_and_without_failures(rng)
            masked = mask_failures(with_failures)
            assert masked.groups_dropped == 0
            got = group_advantages(masked.groups, cfg)
            want = group_advantages(without, cfg)
            assert got == want
            assert train_sequences(masked.groups, got, cfg.algorithm) == train_sequences(
                without, want, cfg.algorithm
            )
            # the sample log's layout: every taken response, 0 where masked
            spread = masked.spread(got)
            for sg, values, kept in zip(with_failures, spread, masked.kept, strict=True):
                assert len(values) == len(sg.verdicts)
                assert [v for v, k in zip(values, kept, strict=True) if k] == got[
                    with_failures.index(sg)
                ]


def test_failures_are_counted_by_reason_and_small_groups_dropped():
    rng = random.Random(0)
    groups = [
        group(0, [member(rng), failed(rng, "verifier_timeout"), member(rng)]),
        group(1, [member(rng), failed(rng, "environment_error"), failed(rng, "tool_worker_lost")]),
        group(2, [failed(rng, "environment_deadline"), failed(rng, "verifier_error")]),
        group(3, [member(rng), member(rng)]),
    ]
    masked = mask_failures(groups)
    assert masked.failures == {
        "verifier_timeout": 1,
        "environment_error": 1,
        "tool_worker_lost": 1,
        "environment_deadline": 1,
        "verifier_error": 1,
    }
    assert masked.groups_dropped == 2  # one valid member left, and none
    assert [len(g.verdicts) for g in masked.groups] == [2, 2]
    assert masked.groups[1] is groups[3]  # a group without failures is itself
    assert masked.kept == [[True, False, True], [False] * 3, [False] * 2, [True, True]]
    assert masked.figures() == {
        "infra_failures": dict(masked.failures),
        "groups_dropped_infra": 2,
        "infra_failure_share": 5 / 10,
    }


def test_a_wrong_answer_stays_a_zero():
    rng = random.Random(1)
    right, wrong = member(rng), member(rng)
    right[1].reward, wrong[1].reward = 1.0, 0.0
    sg = group(0, [right, wrong, failed(rng, "verifier_timeout")])
    masked = mask_failures([sg])
    assert valid_rewards(sg) == [1.0, 0.0]
    assert masked.groups[0].rewards == [1.0, 0.0] and not masked.failures.keys() - {
        "verifier_timeout"
    }
    (advantages,) = group_advantages(masked.groups, build_config({}, []))
    assert advantages[1] < 0 < advantages[0]  # the wrong answer is trained on, pushed down


def step_failing(share: float) -> list[ScoredGroup]:
    rng = random.Random(2)
    failures = round(share * 10)
    members = [failed(rng, "verifier_error") for _ in range(failures)]
    members += [member(rng) for _ in range(10 - failures)]
    return [group(0, members[:5]), group(1, members[5:])]


def test_past_the_share_the_job_warns_once_and_stops_when_it_persists(caplog):
    rule = InfraFailures(build_config({}, ["reward.max_infra_failure_share=0.25"]))
    with caplog.at_level(logging.WARNING, logger="groupflow.loop.infra_failures"):
        for _ in range(3):  # a step within the share starts the count again
            for _ in range(STEPS_TO_STOP - 1):
                assert rule.mask(step_failing(0.3)) is not None
            assert rule.mask(step_failing(0.2)) is not None
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "3 of 10 responses" in warnings[0]
    for _ in range(STEPS_TO_STOP - 1):
        rule.mask(step_failing(0.3))
    with pytest.raises(InfraFailureError) as raised:
        rule.mask(step_failing(0.3))
    message = str(raised.value)
    assert "\n" not in message and message.startswith("verifier_error: 3 of 10 responses")
    assert "reward.max_infra_failure_share=0.25" in message


def test_a_step_left_with_too_few_groups_is_taken_again():
    rule = InfraFailures(build_config({}, ["learner.mini_batches_per_step=2"]))
    assert rule.mask(step_failing(0.6)) is None  # one group left for two mini-batches
    assert rule.mask(step_failing(0.0)) is not None


class FailingRewards(job_loop_fakes.FakeRewards):
    """The verifier fails on the first response of every group of prompts below `below`."""

    below = 0

    def submit(self, groups, chunk_id):
        super().submit(groups, chunk_id)
        if chunk_id >= 0:
            _, batch = self.batches[-1]
            for sg in batch.value:
                if int(sg.group.prompt.uid) < self.below:
                    sg.verdicts[0] = Verdict(0.0, "scorer process died", "error")


def test_the_job_trains_on_the_valid_members_only(monkeypatch):
    monkeypatch.setattr(job_loop_fakes, "FakeRewards", FailingRewards)
    learners = []
    monkeypatch.setattr(
        job_loop_fakes, "FakeLearner", lambda *a: learners.append(FakeLearner(*a)) or learners[-1]
    )
    monkeypatch.setattr(FailingRewards, "below", 2)  # two groups of step 1 lose a member
    run = run_job(steps=2)
    first = run.records[0]
    assert first["infra_failures"] == {"verifier_error": 2}
    assert first["groups_dropped_infra"] == 2  # one valid member left of GROUP_SIZE = 2
    assert first["infra_failure_share"] == 2 / (PROMPTS_PER_STEP * GROUP_SIZE)
    assert first["num_groups"] == PROMPTS_PER_STEP - 2 and first["reward_mean"] == 0.5
    trained = learners[0].steps[0]
    assert len(trained) == (PROMPTS_PER_STEP - 2) * GROUP_SIZE
    assert {s.input_ids[0] for s in trained} == set(range(2, PROMPTS_PER_STEP))
    assert run.records[1]["infra_failures"] == {}


def test_a_job_whose_failures_persist_stops_in_one_line(monkeypatch):
    monkeypatch.setattr(job_loop_fakes, "FakeRewards", FailingRewards)
    monkeypatch.setattr(FailingRewards, "below", 10**9)  # half of every group fails
    with pytest.raises(InfraFailureError, match="^verifier_error: 8 of 16 responses"):
        run_job(steps=5)  # each group is left with one member: dropped, the step taken again
