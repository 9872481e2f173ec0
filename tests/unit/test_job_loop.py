"""The job loop (groupflow.loop.job.TrainingJob) over in-process fakes on a virtual clock
(tests/unit/job_loop_fakes.py)."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from groupflow.actors.starting import ASK_AGAIN_S
from groupflow.core.peers import CHUNKS_PER_ENGINE
from groupflow.core.placement import NOTE_AFTER_S
from groupflow.core.records import Prompt
from groupflow.core.recovery import RestartsExhausted
from groupflow.core.sync_probe import SyncProbeMismatch
from groupflow.core.weight_format import WeightSyncMismatch
from groupflow.loop.checkpoint import CheckpointStore
from groupflow.loop.held_out import EVAL_CHUNK
from groupflow.loop.pipeline import HEARTBEAT_S
from groupflow.loop.prompt_stream import MAX_REFILLS
from groupflow.loop.scaling import Scaler
from groupflow.observe.catalogue import BY_KEY
from groupflow.observe.learning_signal import nothing_learned
from tests.unit.job_loop_fakes import (
    GROUP_SIZE,
    PROMPTS_PER_STEP,
    CountingTask,
    Faults,
    Run,
    run_job,
    scored_at,
    step_prompts,
    trained_prompts,
    varied,
)


# ----- staleness --------------------------------------------------------------------------------
def test_staleness_zero_trains_each_step_on_its_own_fresh_samples():
    run = run_job(steps=4, staleness=0)
    assert [r["staleness_max"] for r in run.records] == [0, 0, 0, 0]
    for step, seqs in enumerate(run.learner.steps):
        assert {s.policy_version for s in seqs} == {step}
    assert trained_prompts(run) == [step_prompts(8 * s) for s in range(4)]


def test_staleness_one_is_exactly_one_version_behind_after_the_first_step():
    run = run_job(steps=5, staleness=1)
    assert [r["staleness_max"] for r in run.records] == [0, 1, 1, 1, 1]
    assert [r["staleness_mean"] for r in run.records] == [0, 1, 1, 1, 1]
    assert [r["policy_version"] for r in run.records] == [1, 2, 3, 4, 5]
    # every prompt trained once, in order, and nothing generated past the last step
    assert trained_prompts(run) == [step_prompts(8 * s) for s in range(5)]
    assert {uid for _, _, _, uids in (e for e in run.log if e[0] == "score") for uid in uids} == {
        str(i) for i in range(40)
    }


@pytest.mark.parametrize("k", [2, 4, 8])
def test_a_slow_learner_trains_samples_exactly_max_staleness_old(k):
    """Learner-bound (100 s a step against 4 s of generation): the engines run k steps ahead,
    so the lag grows to k and stays there, never beyond; the learner never waits after the
    first step, and every prompt is trained once, in order."""
    run = run_job(steps=k + 3, staleness=k, learn_s=100.0)
    assert [r["staleness_max"] for r in run.records] == [min(s, k) for s in range(k + 3)]
    assert trained_prompts(run) == [step_prompts(8 * s) for s in range(k + 3)]
    first_rollout = PROMPTS_PER_STEP * 1.0 / 2  # seconds, on 2 engines
    assert run.clock.now <= first_rollout + (k + 3) * 100.0 + 1e-9
    assert all(r["groups_dropped_stale"] == 0 for r in run.records)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_engines_never_wait_for_the_learner_when_generation_is_the_bottleneck(k):
    """Generation-bound (4 s of generation a step on 2 engines, 1 s of learning): the engines
    are busy from the first chunk to the last, but for the weight loads (0.1 s each)."""
    steps = 8
    run = run_job(steps=steps, staleness=k, learn_s=1.0, seconds_per_prompt=1.0)
    generation = steps * PROMPTS_PER_STEP * 1.0 / 2  # per engine
    loads = (steps - 1) * 0.1
    last_step_learns = 1.0
    assert run.clock.now <= generation + loads + last_step_learns + 1e-9
    assert all(r["staleness_max"] <= k for r in run.records)
    # idle only while the last step learns: nothing is left to draw
    assert [r["time_engines_idle_s"] for r in run.records] == [0.0] * (steps - 1) + [1.0]


@pytest.mark.parametrize("k", [1, 2])
def test_slow_scoring_holds_up_no_engine(k):
    """Each batch takes 3 s to score, longer than a chunk takes to generate (2 s): while the
    loop waits for a chunk's scores, finished chunks still go to the reward pool and engines
    with room get their next chunks (a wait on the reward pool alone would leave them idle),
    so the engines idle only in the last step, with nothing left to draw."""
    steps = 8
    run = run_job(steps=steps, staleness=k, learn_s=1.0, seconds_per_prompt=1.0, score_s=3.0)
    idle = [r["time_engines_idle_s"] for r in run.records]
    assert idle[:-1] == [0.0] * (steps - 1), idle
    assert all(r["time_reward_s"] > 0 for r in run.records)  # the scores were waited for
    assert trained_prompts(run) == [step_prompts(8 * s) for s in range(steps)]


@pytest.mark.parametrize("k", [1, 2])
def test_a_slow_learner_side_sync_holds_up_no_engine(k):
    """The learner's side of each weight sync takes 2 s (a large model into the object
    store), learning 0.5 s, generation 4 s a step: while the loop waits for the sync, finished
    chunks still go to the reward pool and engines with room get their next chunks, so the
    engines idle only in the last step, with nothing left to draw."""
    steps = 8
    run = run_job(steps=steps, staleness=k, learn_s=0.5, seconds_per_prompt=1.0, sync_s=2.0)
    idle = [r["time_engines_idle_s"] for r in run.records]
    assert idle[:-1] == [0.0] * (steps - 1), idle
    generation, loads = steps * PROMPTS_PER_STEP * 1.0 / 2, (steps - 1) * 0.1  # per engine
    assert run.clock.now <= generation + loads + 0.5 + 2.0 + 1e-9  # + the last learn and sync
    synced = {e[1] for e in run.log if e[0] == "get" and e[1].startswith("learner side")}
    assert synced == {f"learner side of sync {v}" for v in range(1, steps + 1)}
    assert trained_prompts(run) == [step_prompts(8 * s) for s in range(steps)]


def test_at_staleness_zero_the_engines_wait_while_the_learner_trains():
    run = run_job(steps=3, staleness=0, learn_s=5.0)
    assert [r["time_engines_idle_s"] for r in run.records] == pytest.approx([5.0] * 3)


def test_weight_loads_wait_behind_at_most_chunks_per_engine():
    """A load sent to a busy engine that finishes its requests first (these fakes do, as with
    rollout.partial_rollout false) waits behind the few chunks it holds, not behind every
    prompt drawn ahead: CHUNKS_PER_ENGINE chunks of 2 prompts (1 s each)."""
    run = run_job(steps=8, staleness=8, learn_s=3.0, seconds_per_prompt=1.0)
    waits = [w for engine in run.engines for w in engine.queued_at_load]
    assert waits and max(waits) <= CHUNKS_PER_ENGINE * 2 * 1.0 + 1e-9


def test_a_sample_older_than_max_staleness_is_dropped_and_counted():
    # Engine 1 misses its load of version 1: its chunks of step 3 come from version 0, two
    # versions behind the learner.
    run = run_job(steps=5, staleness=1, faults=Faults(skip_loads={(1, 1)}), learn_s=4.0)
    assert sum(r["groups_dropped_stale"] for r in run.records) > 0
    assert all(r["staleness_max"] <= 1 for r in run.records)
    assert all(r["num_groups"] == PROMPTS_PER_STEP for r in run.records)


def test_engines_that_never_load_stop_the_job():
    with pytest.raises(RuntimeError, match="trainer.max_staleness=1"):
        run_job(steps=4, staleness=1, faults=Faults(loads=False))


# ----- streaming --------------------------------------------------------------------------------
def test_chunks_reach_the_reward_pool_as_each_finishes():
    run = run_job(steps=1, staleness=0, engines=2, seconds_per_prompt=1.0)
    # 8 prompts, 2 engines: 4 chunks of 2, two per engine, finishing at t=2 and t=4 on each
    assert sorted(scored_at(run)) == [(0, 2.0), (1, 2.0), (2, 4.0), (3, 4.0)]
    scored = [uids for e in run.log if e[0] == "score" for uids in [e[3]]]
    assert sorted(int(u) for uids in scored for u in uids) == step_prompts(0)
    assert [e.prompts_sampled for e in run.engines] == [4, 4]  # least outstanding work


def test_scoring_overlaps_learning():
    """A chunk of step 2 is scored while step 1 learns, before its result is collected."""
    run = run_job(steps=2, staleness=1, learn_s=100.0, seconds_per_prompt=1.0)
    learn_1 = next(i for i, e in enumerate(run.log) if e[:2] == ("get", "learn 1"))
    learning_ends = run.log[learn_1][2]
    # step 1's prompts are chunks 0-3, step 2's chunks 4-7
    step_2_scores = [i for i, e in enumerate(run.log) if e[0] == "score" and e[1] >= 4]
    assert step_2_scores and all(i < learn_1 for i in step_2_scores)
    assert all(t < learning_ends for chunk, t in scored_at(run) if chunk >= 4)


# ----- dynamic sampling -------------------------------------------------------------------------
def odd_prompts_vary(prompt, j):
    """Even prompts are all wrong (a flat group, no signal); odd prompts split their group
    (held-out prompts, "e<i>", are all right)."""
    if not prompt.uid.isdigit():
        return 1.0
    return float(int(prompt.uid) % 2 and j % 2)


def test_dynamic_sampling_refills_flat_groups_from_new_prompts():
    run = run_job(steps=1, reward=odd_prompts_vary, overrides=["algorithm.dynamic_sampling=true"])
    # The first rollout has 4 informative groups; one more rollout brings 4 more.
    (prompts,) = trained_prompts(run)
    assert prompts == [1, 3, 5, 7, 9, 11, 13, 15]
    assert run.records[0]["num_groups"] == PROMPTS_PER_STEP


def test_dynamic_sampling_gives_up_after_its_refills():
    run = run_job(steps=1, reward=lambda p, j: 0.0, overrides=["algorithm.dynamic_sampling=true"])
    # No group ever varies: the step trains on the first rollout after MAX_REFILLS draws.
    assert trained_prompts(run) == [step_prompts(0)]
    scored = {int(u) for e in run.log if e[0] == "score" for u in e[3]}
    assert scored == set(range(PROMPTS_PER_STEP * (1 + MAX_REFILLS)))


# ----- the record -------------------------------------------------------------------------------
def test_every_key_of_the_step_record_is_in_the_catalogue():
    run = run_job(steps=2, staleness=1, overrides=["trainer.eval_every=1"])
    for record in run.records:
        assert set(record) <= BY_KEY.keys(), set(record) - BY_KEY.keys()
    assert "eval_accuracy" in run.records[0] and "eval_accuracy" not in run.records[1]
    assert run.records[0]["optimizer_updates"] == 2  # the learner's results reached its figures
    assert run.records[0]["num_sequences"] == PROMPTS_PER_STEP * GROUP_SIZE


def test_the_record_counts_the_groups_whose_rewards_differ():
    run = run_job(steps=2, reward=odd_prompts_vary)
    assert [r["groups_with_spread"] for r in run.records] == [PROMPTS_PER_STEP // 2] * 2
    assert nothing_learned(run.records) is None
    flat = run_job(steps=2, reward=lambda p, j: 0.0)
    assert [r["groups_with_spread"] for r in flat.records] == [0, 0]
    assert "(every reward was 0)" in nothing_learned(flat.records)


# ----- checkpoints and resume -------------------------------------------------------------------
@pytest.mark.parametrize("staleness", [0, 1])
@pytest.mark.parametrize("dynamic", [False, True])
def test_a_resumed_job_trains_what_the_straight_one_does(tmp_path, staleness, dynamic):
    """6 steps straight against a job that dies after step 5 (its newest checkpoint is step
    4's, saved while step 5's rollout was in flight) and a resume to step 6: the same
    prompts in the same order and the same learner state."""
    opts = dict(staleness=staleness, reward=odd_prompts_vary if dynamic else varied)
    overrides = ["trainer.checkpoint_every=2", "trainer.keep_checkpoints=1"]
    if dynamic:
        overrides.append("algorithm.dynamic_sampling=true")
    straight = run_job(steps=6, run_dir=tmp_path / "straight", overrides=overrides, **opts)
    first = run_job(steps=5, run_dir=tmp_path / "cut", overrides=overrides, **opts)
    resumed = run_job(steps=6, run_dir=tmp_path / "cut", overrides=overrides, resume=True, **opts)

    assert trained_prompts(first)[:4] + trained_prompts(resumed) == trained_prompts(straight)
    assert (resumed.learner.weights, resumed.learner.moment) == (
        straight.learner.weights,
        straight.learner.moment,
    )
    assert [r["step"] for r in resumed.records] == [5, 6]
    assert [r["policy_version"] for r in resumed.records] == [5, 6]
    # only the newest checkpoint is kept
    assert [p.name for p in CheckpointStore(tmp_path / "cut").complete()] == ["step_6"]


def test_checkpoint_figures_are_in_the_records(tmp_path):
    run = run_job(steps=3, run_dir=tmp_path, overrides=["trainer.checkpoint_every=1"])
    assert "checkpoint_seconds" not in run.records[0]  # no save yet when step 1 is recorded
    assert all(r["checkpoint_seconds"] > 0 for r in run.records[1:])
    assert all(r["seconds_since_checkpoint"] >= 0 for r in run.records)
    for record in run.records:
        assert set(record) <= BY_KEY.keys(), set(record) - BY_KEY.keys()


def test_the_save_overlaps_the_next_rollout(tmp_path):
    """On-policy, the next step's rollout is launched before the ranks save, so the engines
    generate while the shards are written."""
    run = run_job(steps=2, run_dir=tmp_path, overrides=["trainer.checkpoint_every=1"])
    step_2_scores = [e[2] for e in run.log if e[0] == "score" and e[1] == 1]
    save_done = next(e[2] for e in run.log if e[:2] == ("get", "save"))
    assert step_2_scores and min(step_2_scores) < save_done


# ----- recovery ---------------------------------------------------------------------------------
def scored_prompts(run: Run) -> list[int]:
    return sorted(int(u) for e in run.log if e[0] == "score" for u in e[3])


@pytest.mark.parametrize(
    "engines, staleness, dies_at",
    [
        (1, 0, 1),  # the one engine dies in its first chunk, its second queued behind it
        (1, 0, 2),  # ... in its second chunk
        (2, 0, 2),  # engine 0 dies in step 2's rollout
        (2, 1, 2),  # ... while step 1 learns
        (2, 1, 3),
    ],
)
def test_a_dead_engine_is_replaced_and_its_chunks_generated_again(engines, staleness, dies_at):
    run = run_job(
        steps=4,
        staleness=staleness,
        engines=engines,
        faults=Faults(engine_dies_at_chunk=(dies_at,)),
    )
    straight = run_job(steps=4, staleness=staleness, engines=engines)
    assert trained_prompts(run) == trained_prompts(straight)
    assert scored_prompts(run) == scored_prompts(straight)  # no group lost or scored twice
    for step, seqs in enumerate(run.learner.steps):
        # the replacement sampled with the current weights, never the base model's (a chunk
        # sent again after a weight sync samples from the newer version)
        assert {s.policy_version for s in seqs} <= set(range(max(0, step - staleness), step + 1))
        if staleness == 0:
            assert {s.policy_version for s in seqs} == {step}
    assert [r["engine_restarts"] for r in run.records][-1] == 1
    assert not run.engines[0].dead and run.engines[0].version == 4
    # only the replacement was sent the weights it awaited: the survivor loads each version once
    survivors = run.engines[1:], straight.engines[1:]
    assert [len(e.queued_at_load) for e in survivors[0]] == [
        len(e.queued_at_load) for e in survivors[1]
    ]


@pytest.mark.parametrize("dies_at", ["load 2", "greedy"])
def test_an_engine_dying_in_a_weight_sync_or_an_evaluation_is_replaced(dies_at):
    overrides = ["trainer.eval_every=2"]
    run = run_job(steps=4, faults=Faults(engine_dies_at=dies_at), overrides=overrides)
    straight = run_job(steps=4, overrides=overrides)
    assert trained_prompts(run) == trained_prompts(straight)
    assert run.records[-1]["engine_restarts"] == 1
    assert run.records[1]["eval_accuracy"] == straight.records[1]["eval_accuracy"]
    assert [e.version for e in run.engines] == [4, 4]


def test_engines_dying_in_a_row_end_the_job_after_max_restarts():
    with pytest.raises(RuntimeError, match=r"trainer.max_restarts=1"):
        # the engine and each replacement die in their first chunk
        run_job(
            steps=2,
            engines=1,
            faults=Faults(engine_dies_at_chunk=(1, 1, 1)),
            overrides=["trainer.max_restarts=1"],
        )


class PendingGauges:
    """The live series as the job sets them (groupflow.loop.scaling.LiveGauges), on its clock."""

    def __init__(self, clock):
        self.clock, self.pending = clock, []  # (virtual time, pool, count)

    def set_cluster(self, engines, reward_workers, learner_ranks):
        pass

    def set_pending(self, pool, count):
        self.pending.append((self.clock(), pool, count))


def _lost_engine_job(engines: int, waits_s: float) -> tuple[Run, PendingGauges]:
    """A job whose engine 0 dies in its second chunk and whose replacement waits `waits_s`
    (virtual) seconds for a node, with the Scaler and the pending series it sets."""
    made = []

    def scaler(pool, rewards):
        made.append(PendingGauges(pool._clock))
        return Scaler("unit", pool, rewards, 1, gauges=made[-1], log=lambda line: None)

    run = run_job(
        steps=4,
        engines=engines,
        faults=Faults(engine_dies_at_chunk=(2,), replacement_waits_s=waits_s),
        scaler=scaler,
    )
    return run, made[0]


def test_an_engine_whose_replacement_waits_for_a_node_leaves_its_work_to_the_others(caplog):
    """Generation goes on with the engine left, at half the rate; the replacement counts as
    pending, never as live, and the death is said once and counted once."""
    caplog.set_level(logging.INFO)
    run, gauges = _lost_engine_job(engines=2, waits_s=1000.0)
    straight = run_job(steps=4, engines=2)
    assert trained_prompts(run) == trained_prompts(straight)
    assert scored_prompts(run) == scored_prompts(straight)
    assert [r["engine_restarts"] for r in run.records] == [1, 1, 1, 1]
    assert [r["num_engines"] for r in run.records] == [1, 1, 1, 1]
    (replacement,) = run.started
    assert replacement.prompts_sampled == 0  # never placed within the job
    assert run.engines[1].prompts_sampled == 4 * PROMPTS_PER_STEP - run.engines[0].prompts_sampled
    assert run.clock.now < 1000.0  # nothing waited for it
    lost = [r.message for r in caplog.records if "lost" in r.message]
    assert lost == [
        "engine 0 lost (died); a replacement is asked for; generation goes on with 1 engine(s)"
    ]
    assert all(count == 1 for _, pool, count in gauges.pending if pool == "engines")
    status = run.job.scaler.status(4)
    assert status.engines.live == 1 and status.engines.pending == 1


def test_a_job_that_lost_every_engine_waits_for_a_replacement_and_says_what_it_waits_for(
    caplog,
):
    """The one engine dies; its replacement has no node for 200 s. The step waits, its live
    series move every HEARTBEAT_S, the wait is said once with what the replacement asks and
    what the cluster has, and the job goes on when the replacement is up: each step once."""
    caplog.set_level(logging.INFO)
    run, gauges = _lost_engine_job(engines=1, waits_s=200.0)
    straight = run_job(steps=4, engines=1)
    assert trained_prompts(run) == trained_prompts(straight)
    assert scored_prompts(run) == scored_prompts(straight)
    assert [r["engine_restarts"] for r in run.records][-1] == 1
    (replacement,) = run.started
    assert replacement.prompts_sampled > 0 and replacement.version == 4
    waiting = [t for t, pool, count in gauges.pending if pool == "engines" and count == 1]
    assert len(waiting) >= 200 / HEARTBEAT_S - 2  # published through the wait
    assert max(waiting) - min(waiting) > 190
    said = [r.message for r in caplog.records]
    assert sum("no engine is left: generation waits for it" in m for m in said) == 1
    (room,) = [m for m in said if m.startswith("engine 0's replacement has waited")]
    assert room.startswith(f"engine 0's replacement has waited {NOTE_AFTER_S:.0f}s for room")
    assert "it asks {CPU: 1}; the cluster has 1 live node: CPU 0 free of 1" in room
    (stalled,) = [m for m in said if m.startswith("step ") and "has waited" in m]
    assert "engines: 0 live, target 1 (1 pending: no room on the cluster)" in stalled


def test_an_engine_lost_is_published_when_it_is_lost_not_at_the_next_heartbeat():
    """`groupflow status` and the live series show the loss at the moment the loop sees it
    (the moment the driver says so), so that a status read after that line shows it too;
    then every HEARTBEAT_S while the step waits."""
    gauges, said_at = [], []

    class AtLoss(logging.Handler):
        def emit(self, record):
            if "no engine is left" in record.getMessage():
                said_at.append(gauges[0].clock())

    def scaler(pool, rewards):
        gauges.append(PendingGauges(pool._clock))
        return Scaler("unit", pool, rewards, 1, gauges=gauges[0], log=lambda line: None)

    handler, pool_log = AtLoss(), logging.getLogger("groupflow.actors.generator")
    pool_log.addHandler(handler)
    try:
        run_job(
            steps=2,
            engines=1,
            faults=Faults(engine_dies_at_chunk=(2,), replacement_waits_s=30.0),
            scaler=scaler,
        )
    finally:
        pool_log.removeHandler(handler)
    waiting = [t for t, pool, count in gauges[0].pending if pool == "engines" and count == 1]
    assert said_at and waiting[0] == said_at[0]  # on the grid of heartbeats it would be later
    assert all(b - a <= HEARTBEAT_S for a, b in zip(waiting, waiting[1:], strict=False))


def test_a_replacement_that_dies_starting_with_its_node_is_asked_again_not_charged(caplog):
    """The cluster may place a replacement on the node being lost before it counts that node
    dead: such a start fails from outside, is asked for again ASK_AGAIN_S later, and is no
    restart; the job goes on as with one death."""
    caplog.set_level(logging.WARNING)
    run = run_job(
        steps=3,
        engines=1,
        faults=Faults(engine_dies_at_chunk=(2,), replacement_starts=("dies", "dies")),
        overrides=["trainer.max_restarts=1"],
    )
    straight = run_job(steps=3, engines=1)
    assert trained_prompts(run) == trained_prompts(straight)
    assert [r["engine_restarts"] for r in run.records][-1] == 1
    assert len(run.started) == 3 and run.started[-1].prompts_sampled > 0
    again = [r.message for r in caplog.records if "asking again" in r.message]
    assert (
        again
        == [
            "an engine replacement failed to start: dies; not an error of its own (its node "
            f"lost?): asking again in {ASK_AGAIN_S:.0f}s"
        ]
        * 2
    )


def test_a_replacement_that_fails_to_start_is_a_restart_naming_its_own_error():
    error = "FileNotFoundError: [Errno 2] No such file or directory: '/models/m' (ip=10.0.0.7)"
    with pytest.raises(RestartsExhausted) as failed:
        run_job(
            steps=2,
            engines=1,
            faults=Faults(engine_dies_at_chunk=(1,), replacement_starts=(error,) * 3),
            overrides=["trainer.max_restarts=2"],
        )
    line = str(failed.value)
    assert "\n" not in line
    assert "an engine replacement failed to start on node 10.0.0.7: FileNotFoundError" in line
    assert "3 restarts without a new step" in line


@pytest.mark.parametrize("staleness", [0, 1])
@pytest.mark.parametrize("dies_in", ["step 4", "the sync after step 3"])
def test_a_dead_learner_rank_rebuilds_the_learner_from_the_newest_checkpoint(
    tmp_path, staleness, dies_in
):
    overrides = ["trainer.checkpoint_every=2"]
    straight = run_job(steps=5, staleness=staleness, run_dir=tmp_path / "a", overrides=overrides)
    in_step = dies_in == "step 4"
    run = run_job(
        steps=5,
        staleness=staleness,
        run_dir=tmp_path / "b",
        overrides=overrides,
        faults=Faults(
            learner_dies_in_step=4 if in_step else 0,
            rank_dies_in_sync=None if in_step else 3,  # every engine's load of it fails too
            engine_dies_at_chunk=(2,),  # and an engine in step 1: counted once over the rebuild
        ),
    )
    # steps 1-3 trained, a rank died, the ranks came back at step 2's checkpoint and trained
    # 3-5 again on the same prompts
    assert run.learner.restarts == 1
    died = run.learner.steps.index("restarted")
    assert died == 3
    again = [sorted({s.input_ids[0] for s in seqs}) for seqs in run.learner.steps[died + 1 :]]
    assert again == trained_prompts(straight)[2:]
    assert (run.learner.weights, run.learner.moment) == (
        straight.learner.weights,
        straight.learner.moment,
    )
    assert [e.version for e in run.job.generators.engines] == [5, 5], "the last version"
    # the driver rewinds the file to step 2; step 3 has a record only if its sync ended
    steps = [1, 2, 3, 3, 4, 5] if in_step else [1, 2, 3, 4, 5]
    assert [r["step"] for r in run.records] == steps
    assert [r["learner_restarts"] for r in run.records] == [0] * (len(steps) - 3) + [1] * 3
    assert [r["engine_restarts"] for r in run.records] == [1] * len(steps)


# ----- verified weight syncs -------------------------------------------------------------------
@pytest.mark.parametrize("staleness", [0, 2])
def test_every_finished_load_is_checked_and_the_records_count_the_verified_ones(staleness):
    run = run_job(steps=5, staleness=staleness, engines=2)
    checked = run.job.pipeline.transport.checked
    # each engine's loads of versions 1-4 finished while the job ran (the last sync's may not)
    assert sorted(v for v in checked if v is not None)[: 2 * 4] == sorted([1, 2, 3, 4] * 2)
    assert sum(r["weight_sync_verified"] for r in run.records) == len(checked) > 0


def test_an_abandoned_load_is_checked_but_not_counted_as_verified(tmp_path):
    run = run_job(
        steps=4,
        run_dir=tmp_path,
        overrides=["trainer.checkpoint_every=1"],
        faults=Faults(rank_dies_in_sync=2),  # the engines abandon their loads of version 2
    )
    checked = run.job.pipeline.transport.checked
    assert checked.count(None) == 2
    verified = sum(r["weight_sync_verified"] for r in run.records)
    assert 0 < verified <= len(checked) - 2


def test_a_load_that_fails_its_check_stops_the_job():
    with pytest.raises(WeightSyncMismatch, match="policy version 2"):
        run_job(steps=4, staleness=1, faults=Faults(corrupt_sync_at=2))


def test_the_records_carry_the_sync_probe_of_the_loads_checked_since_the_previous_step():
    run = run_job(steps=5, staleness=1, engines=2)
    probed = [r for r in run.records if r["weight_sync_verified"]]
    assert probed, "loads were checked"
    for r in run.records:
        assert ("sync_probe_diff_max" in r) == (r["weight_sync_verified"] > 0), r
    assert all(r["sync_probe_diff_max"] == r["sync_probe_diff_mean"] == 0.0 for r in probed)


def test_a_load_whose_sync_probe_is_off_stops_the_job_in_one_line():
    with pytest.raises(SyncProbeMismatch) as err:
        run_job(steps=4, staleness=1, faults=Faults(probe_off_at=2))
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("weight sync of policy version 2: engine 0 computes other log-probs")
    assert "worst at token 2 (id 7) of probe sequence 0: engine -1.5, learner -2" in line


def test_a_load_on_an_engine_that_died_is_forgotten_not_checked():
    run = run_job(steps=3, faults=Faults(engine_dies_at="load 2"))
    assert run.job.pipeline.transport.forgotten == 1
    assert 2 not in [v for v in run.job.pipeline.transport.checked if v is not None][:1]


def test_held_out_scores_greedy_and_sampled_through_the_reward_pool():
    overrides = ["trainer.eval_every=2", "trainer.eval_samples=4", "trainer.eval_pass_k=2"]
    run = run_job(steps=3, reward=varied, overrides=overrides)
    record = run.records[1]
    # varied: answer j of a group gets j % 2, so greedy answers (j = 0) all fail, and each
    # prompt's 4 samples pass twice: mean@4 = 1/2, pass@2 = 1 - C(2,2)/C(4,2) = 5/6
    assert record["eval_accuracy"] == 0.0
    assert record["eval_mean_at_n"] == pytest.approx(0.5)
    assert record["eval_pass_at_k"] == pytest.approx(5 / 6)
    held_out = [e for e in run.log if e[0] == "score held-out"]
    # before training and at step 2: greedy, then sampled
    assert len(held_out) == 4 and all(e[1] == EVAL_CHUNK for e in held_out)
    assert "eval_mean_at_n" not in run.records[0]


class TwoTasks(CountingTask):
    """A mixture's held-out prompts: each labelled with its task, "even" or "odd"."""

    def eval_prompts(self, n):
        return [replace(p, task=("even", "odd")[p.answer % 2]) for p in super().eval_prompts(n)]


def even_answers_pass(prompt, j):
    return float(prompt.answer % 2 == 0)


def test_a_mixture_is_scored_per_task_too_and_a_resume_keeps_the_warm_start_scores(tmp_path):
    opts = dict(reward=even_answers_pass, task=TwoTasks(), run_dir=tmp_path)
    overrides = ["trainer.checkpoint_every=1", "trainer.eval_every=1"]
    run = run_job(steps=2, overrides=overrides, **opts)
    warm = {"eval_accuracy": 0.5, "eval_task_accuracy": {"even": 1.0, "odd": 0.0}}
    assert run.job.evaluation.before_training == warm
    assert run.records[0]["eval_task_accuracy"] == {"even": 1.0, "odd": 0.0}
    resumed = run_job(steps=3, overrides=overrides, resume=True, **opts)
    assert (
        resumed.job.evaluation.before_training == warm
    )  # from the checkpoint: summary.json reports it
    assert "eval_task_accuracy" not in run_job(steps=1).job.evaluation.before_training  # one task


class FakeHeldOutSet:
    """A held-out set of another task: its own prompts and scorer."""

    def __init__(self, name: str, size: int):
        self.name = name
        self.prompts = [Prompt(f"{name}{i}", f"{name} {i}", i) for i in range(size)]
        self.scored: list[list] = []

    def rewards(self, groups):
        self.scored.append([g.prompt.uid for g in groups])
        return [[float(g.prompt.answer % 2 == 0)] * len(g.responses) for g in groups]


def test_extra_held_out_sets_are_scored_by_their_own_scorer_and_reported_by_name():
    sets = [FakeHeldOutSet("even", 4), FakeHeldOutSet("more", 5)]
    run = run_job(steps=2, overrides=["trainer.eval_every=1"], held_out_sets=sets)
    record = run.records[0]
    # answers of prompt i score 1 when i is even: 2 of 4, 3 of 5
    assert record["eval_set_accuracy"] == {"even": 0.5, "more": 0.6}
    assert "eval_set_mean_at_n" not in record
    assert sets[0].scored[0] == ["even0", "even1", "even2", "even3"]
