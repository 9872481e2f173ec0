"""Steps without a group whose rewards differ: the warning while a job runs, and the end line of
a run that had nothing to learn from (groupflow/observe/learning_signal.py), on fake step records."""

from __future__ import annotations

import logging

import pytest

from groupflow.core.records import Prompt, Response, SampledGroup, ScoredGroup, Verdict
from groupflow.observe.learning_signal import NO_SPREAD_WARN_AFTER, SpreadWatch, nothing_learned
from groupflow.observe.rollout_figures import rollout_record


def record(step, spread, mean=0.0, std=0.0):
    return {"step": step, "groups_with_spread": spread, "reward_mean": mean, "reward_std": std}


def warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_rollout_record_counts_the_groups_whose_rewards_differ():
    def group(rewards):
        responses = [Response([1], "", [0.0]) for _ in rewards]
        sampled = SampledGroup(Prompt("u", "", None), [1], responses, 0)
        return ScoredGroup(sampled, [Verdict(r, "") for r in rewards])

    groups = [group([0.0, 0.0]), group([1.0, 1.0]), group([0.0, 1.0]), group([0.5, 0.0, 0.5])]
    assert rollout_record(groups, [0] * 9, {})["groups_with_spread"] == 2


def test_steps_in_a_row_without_a_spread_warn_then_at_each_doubling(caplog):
    watch = SpreadWatch()
    with caplog.at_level(logging.WARNING):
        for step in range(1, NO_SPREAD_WARN_AFTER):
            watch.write(record(step, 0))
        assert not warnings(caplog)
        for step in range(NO_SPREAD_WARN_AFTER, 4 * NO_SPREAD_WARN_AFTER + 1):
            watch.write(record(step, 0))
    n = NO_SPREAD_WARN_AFTER
    assert warnings(caplog) == [
        f"steps 1-{k * n}: no group's rewards differed in {k * n} steps in a row (every reward "
        "was 0): the rewards gave these steps nothing to learn from; does the "
        "verifier find the gold answer? (the reason of each reward is in samples/step_<N>.jsonl "
        "with trainer.log_samples_every; docs/verifiers.md; a worked solution as the gold "
        "answer needs the dataset's fields.answer_format)"
        for k in (1, 2, 4)
    ]


def test_a_step_with_a_spread_starts_the_count_again(caplog):
    watch = SpreadWatch()
    steps = [0] * (NO_SPREAD_WARN_AFTER - 1) + [1] + [0] * (NO_SPREAD_WARN_AFTER - 1) + [3]
    with caplog.at_level(logging.WARNING):
        for step, spread in enumerate(steps, start=1):
            watch.write(record(step, spread))
        assert not warnings(caplog)
        for step in range(len(steps) + 1, len(steps) + 1 + NO_SPREAD_WARN_AFTER):
            watch.write(record(step, 0, mean=1.0))
    (warning,) = warnings(caplog)
    assert warning.startswith(f"steps {len(steps) + 1}-{len(steps) + NO_SPREAD_WARN_AFTER}: ")
    assert "(every reward was 1)" in warning and "take harder prompts" in warning


@pytest.mark.parametrize(
    ("records", "what", "hint"),
    [
        ([record(s, 0) for s in (1, 2, 3)], "every reward was 0", "does the verifier find"),
        ([record(s, 0, 1.0) for s in (1, 2)], "every reward was 1", "take harder prompts"),
        # every group alike, but groups differ from each other (and from step to step)
        (
            [record(1, 0, 0.25, 0.4), record(2, 0, 0.5, 0.5)],
            "rewards differed between groups only",
            "rollout.group_size",
        ),
        ([record(1, 0, 0.5), record(2, 0, 0.5)], "every reward was 0.5", "dynamic_sampling"),
    ],
)
def test_a_run_without_a_spread_in_any_step_ends_with_a_loud_line(records, what, hint):
    line = nothing_learned(records)
    assert line.startswith(f"NOTHING LEARNED: in none of the {len(records)} steps did a group's")
    assert f"({what})" in line and hint in line and "\n" not in line


def test_a_run_with_a_spread_in_one_step_learned_something():
    assert nothing_learned([record(1, 0), record(2, 1), record(3, 0)]) is None


def test_records_without_the_count_say_nothing():
    # an older run's records, before groups_with_spread: neither a warning nor an end line
    old = [{"step": s, "reward_mean": 0.0, "reward_std": 0.0} for s in range(1, 30)]
    assert nothing_learned(old) is None
    assert nothing_learned([]) is None
    assert nothing_learned([*old, record(30, 0)]).startswith("NOTHING LEARNED: in none of the 1 ")


@pytest.mark.parametrize("line", [None, "NOTHING LEARNED: in none of the 3 steps ..."])
def test_groupflow_train_ends_with_the_line_of_a_run_that_learned_nothing(
    monkeypatch, capsys, line
):
    import groupflow.run.driver
    from groupflow.run.cli import main

    summary = {"warm_start_accuracy": 0.0, "final_accuracy": 0.0, "nothing_learned": line}
    monkeypatch.setattr(groupflow.run.driver, "run", lambda cfg, how_to_resume: summary)
    assert main(["train", "--set", "trainer.run_name=flat"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "done: held-out accuracy 0.000 -> 0.000; run directory runs/flat"
    assert out[1:] == ([] if line is None else [line])
