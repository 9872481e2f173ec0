"""One restart budget for engines and learner ranks (groupflow/core/recovery.py): on its own, and
in the job loop on the virtual clock (tests/unit/job_loop_fakes.py)."""

from __future__ import annotations

import pytest

from groupflow.core.recovery import RestartBudget, RestartsExhausted
from tests.unit.job_loop_fakes import Faults, run_job, trained_prompts


def test_engine_and_learner_restarts_draw_on_one_budget():
    budget = RestartBudget(max_in_a_row=2)
    budget.charge("engine", "engine 0 died")
    budget.step_done(1)  # a new step gives the budget back
    budget.charge("learner", "a learner rank died")
    budget.step_done(1)  # a step trained again after the rebuild is not new
    budget.charge("engine", "engine 1 died")
    with pytest.raises(RestartsExhausted, match=r"^engine 1 died: 3 restarts .*max_restarts=2\)$"):
        budget.charge("engine", "engine 1 died")
    assert budget.state_dict() == {"engine_restarts": 3, "learner_restarts": 1}


def test_restarts_only_add_up_over_a_checkpoint():
    budget = RestartBudget(max_in_a_row=3)
    budget.charge("engine", "engine 0 died")
    budget.charge("learner", "a learner rank died")
    budget.load_state_dict({"engine_restarts": 0, "learner_restarts": 0, "reward_errors": 5})
    assert budget.state_dict() == {"engine_restarts": 1, "learner_restarts": 1}
    fresh = RestartBudget(max_in_a_row=3)  # a resumed job goes on from the saved totals
    fresh.load_state_dict({"engine_restarts": 2.0, "learner_restarts": 1.0})
    assert fresh.state_dict() == {"engine_restarts": 2, "learner_restarts": 1}


# Engine 0 samples two chunks a step; a rank dies in step 4 and the ranks come back at step 2's
# checkpoint: engine 0's 9th chunk is step 3's again, before the job got past where it was.
ENGINE_DIES_AFTER_THE_REBUILD = 9
ENGINE_DIES_IN_STEP_1 = 2


@pytest.mark.parametrize("max_restarts", [1, 2])
def test_an_engine_death_after_a_learner_rebuild_counts_against_the_same_budget(
    tmp_path, max_restarts
):
    overrides = ["trainer.checkpoint_every=2", f"trainer.max_restarts={max_restarts}"]
    faults = Faults(learner_dies_in_step=4, engine_dies_at_chunk=(ENGINE_DIES_AFTER_THE_REBUILD,))
    job = dict(steps=5, run_dir=tmp_path / "b", overrides=overrides, faults=faults)
    if max_restarts == 1:
        with pytest.raises(RestartsExhausted, match=r"2 restarts .*max_restarts=1\)"):
            run_job(**job)
        return
    run = run_job(**job)
    straight = run_job(steps=5, run_dir=tmp_path / "a", overrides=overrides)
    died = run.learner.steps.index("restarted")
    again = [sorted({s.input_ids[0] for s in seqs}) for seqs in run.learner.steps[died + 1 :]]
    assert again == trained_prompts(straight)[2:]
    # the engine died in the steps trained again: the records after the rebuild count both
    assert [r["step"] for r in run.records] == [1, 2, 3, 3, 4, 5]
    assert [r["learner_restarts"] for r in run.records] == [0, 0, 0, 1, 1, 1]
    assert [r["engine_restarts"] for r in run.records] == [0, 0, 0, 1, 1, 1]


def test_a_new_step_between_two_deaths_gives_the_budget_back(tmp_path):
    run = run_job(
        steps=5,
        run_dir=tmp_path,
        overrides=["trainer.checkpoint_every=2", "trainer.max_restarts=1"],
        faults=Faults(learner_dies_in_step=4, engine_dies_at_chunk=(ENGINE_DIES_IN_STEP_1,)),
    )
    assert run.records[-1]["engine_restarts"] == 1 and run.records[-1]["learner_restarts"] == 1
