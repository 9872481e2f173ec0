"""The job's checkpoints as the checkpointer writes them (groupflow/loop/checkpointer.py): the
driver's state is the step, the policy version, the provenance and each part's state_dict by
part name; a checkpoint that groupflow wrote before the checkpointer (format 1) resumes; the
pipeline owns the policy version. Over the in-process fakes of tests/unit/job_loop_fakes.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from groupflow.core.errors import CheckpointError
from groupflow.core.recovery import LearnerLost
from groupflow.loop.checkpoint import STATE_FILE, CheckpointStore
from groupflow.loop.checkpointer import read_checkpoint
from groupflow.loop.prompt_stream import StreamState
from tests.unit.job_loop_fakes import (
    MODEL_CONFIG,
    PROMPTS_PER_STEP,
    FakeLearner,
    run_job,
    trained_prompts,
)

SAVE_AT_2 = ["trainer.checkpoint_every=2", "trainer.keep_checkpoints=1"]


def format_1_state(
    step: int,
    consumed: int,
    warm_eval: dict,
    counters: dict,
    files: dict,
    *,
    model_config_json: dict = MODEL_CONFIG,
    num_ranks: int = FakeLearner.num_ranks,
) -> dict:
    """driver_state.json as groupflow wrote it before the checkpointer (main at 4b027db: its
    DriverState, field for field and in its order): the stream's position, the held-out
    scores before training and the running totals each in a field of their own."""
    return {
        "step": step,
        "policy_version": step,
        "stream": {"consumed": consumed},
        "warm_start_accuracy": warm_eval.get("eval_accuracy"),
        "warm_start_eval": warm_eval,
        "counters": counters,
        "model_config_json": model_config_json,
        "num_ranks": num_ranks,
        "adapter": None,
        "files": files,
    }


def as_format_1(checkpoint: Path, **changes) -> dict:
    """Rewrite a checkpoint's driver state as format 1, with `changes` to its fields."""
    state = json.loads((checkpoint / STATE_FILE).read_text())
    parts = state["parts"]
    old = (
        format_1_state(
            state["step"],
            parts["prompt_stream"]["consumed"],
            parts["held_out"],
            {
                "reward_errors": 5.0,
                "reward_timeouts": 2.0,
                "engine_restarts": 3.0,
                "learner_restarts": 1.0,
            },
            state["files"],
        )
        | changes
    )
    (checkpoint / STATE_FILE).write_text(json.dumps(old, indent=1))
    return old


def test_the_driver_state_is_step_version_provenance_and_the_parts(tmp_path):
    run_job(steps=2, run_dir=tmp_path, overrides=SAVE_AT_2)
    saved = json.loads((CheckpointStore(tmp_path).newest() / STATE_FILE).read_text())
    assert list(saved) == ["format", "step", "policy_version", "provenance", "parts", "files"]
    assert (saved["format"], saved["step"], saved["policy_version"]) == (2, 2, 2)
    assert saved["provenance"] == {
        "model_config_json": MODEL_CONFIG,
        "num_ranks": 2,
        "adapter": None,
    }
    assert saved["parts"] == {
        "prompt_stream": {"consumed": 2 * PROMPTS_PER_STEP},
        "restarts": {"engine_restarts": 0, "learner_restarts": 0},
        "reward_totals": {"reward_errors": 0.0, "reward_timeouts": 0.0},
        "held_out": {"eval_accuracy": 0.0},
    }


def test_a_format_1_checkpoint_resumes_where_it_left_off(tmp_path):
    """A job saved at step 2 with its driver state rewritten as main wrote it, then resumed
    to step 4: the prompts, learner state and versions of a straight job, the warm-start
    scores kept and the running totals going on from the old counters."""
    straight = run_job(steps=4, run_dir=tmp_path / "straight", overrides=SAVE_AT_2)
    first = run_job(steps=2, run_dir=tmp_path / "cut", overrides=SAVE_AT_2)
    old = as_format_1(CheckpointStore(tmp_path / "cut").newest())
    assert old["stream"] == {"consumed": 2 * PROMPTS_PER_STEP}

    resumed = run_job(steps=4, run_dir=tmp_path / "cut", overrides=SAVE_AT_2, resume=True)
    assert trained_prompts(first) + trained_prompts(resumed) == trained_prompts(straight)
    assert (resumed.learner.weights, resumed.learner.moment) == (
        straight.learner.weights,
        straight.learner.moment,
    )
    assert [r["policy_version"] for r in resumed.records] == [3, 4]
    assert resumed.job.evaluation.before_training == first.job.evaluation.before_training
    totals = {k: resumed.records[-1][k] for k in old["counters"]}
    assert totals == {
        "reward_errors": 5.0,
        "reward_timeouts": 2.0,
        "engine_restarts": 3,
        "learner_restarts": 1,
    }
    # and its own next save is format 2
    assert (
        json.loads((CheckpointStore(tmp_path / "cut").newest() / STATE_FILE).read_text())["format"]
        == 2
    )


def test_the_oldest_format_1_states_still_load(tmp_path):
    """Before the stream had a state of its own it kept its position as `prompts_consumed`,
    and before every held-out score was kept, the accuracy alone."""
    run_job(steps=2, run_dir=tmp_path, overrides=SAVE_AT_2)
    checkpoint = CheckpointStore(tmp_path).newest()
    old = as_format_1(checkpoint, warm_start_eval={}, warm_start_accuracy=0.5)
    old["prompts_consumed"] = old.pop("stream")["consumed"] - 3
    (checkpoint / STATE_FILE).write_text(json.dumps(old))
    state = read_checkpoint(checkpoint, MODEL_CONFIG, 2)
    assert state.parts.prompt_stream == StreamState(consumed=2 * PROMPTS_PER_STEP - 3)
    assert state.parts.held_out == {"eval_accuracy": 0.5}


@pytest.mark.parametrize(
    "changes",
    [
        {"stream": {"consumed": -32}},
        {"prompts_consumed": 8},  # beside `stream`: one or the other
        {"num_ranks": 0},
        {"warm_start_eval": {}, "warm_start_accuracy": float("nan")},
        {"counters": {"reward_errors": float("inf")}},
        {"counters": {"engine_restarts": -1.0}},
        {"counters": 7},
        {"surprise": 1},
    ],
)
def test_a_hostile_format_1_state_is_refused_in_one_line_naming_the_state_file(tmp_path, changes):
    run_job(steps=2, run_dir=tmp_path, overrides=SAVE_AT_2)
    checkpoint = CheckpointStore(tmp_path).newest()
    as_format_1(checkpoint, **changes)
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(checkpoint, MODEL_CONFIG, 2)
    assert str(err.value).startswith(f"{checkpoint / STATE_FILE}:") and "\n" not in str(err.value)


# ----- the policy version's one owner -----------------------------------------------------------
def test_the_pipeline_owns_the_policy_version():
    """An update that lands moves the version on; one that fails (a lost rank) leaves it,
    and a rebuild sets it: every engine is sent it. Nobody else keeps a copy."""
    run = run_job(steps=2)
    pipeline = run.job.pipeline
    assert pipeline.version == 2 and [r["policy_version"] for r in run.records] == [1, 2]
    assert not hasattr(run.job, "version") and not hasattr(run.job.generators, "version")
    with pipeline.learning():
        pass
    assert pipeline.version == 3
    with pytest.raises(LearnerLost), pipeline.learning():
        raise LearnerLost("a learner rank died in a step")
    assert pipeline.version == 3
    pipeline.restored(1)
    assert pipeline.version == 1 and [e.version for e in run.engines] == [1, 1]
