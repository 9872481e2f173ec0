"""Stopping a job early (groupflow/loop/stopping.py) in the job loop, over the in-process fakes of
tests/unit/job_loop_fakes.py, on their virtual clock; Ctrl-C's handlers; and what a run's end
says (groupflow/run/end.py)."""

from __future__ import annotations

import json
import logging
import os
import signal

import pytest

from groupflow.loop.checkpoint import STATE_FILE, CheckpointStore, Provenance
from groupflow.loop.checkpointer import DriverState, Parts, find_resume
from groupflow.loop.pipeline import HEARTBEAT_S
from groupflow.loop.prompt_stream import StreamState
from groupflow.loop.stopping import StopAborted, StopRequest, stop_on_signals
from groupflow.run.end import already_finished as finished_line
from groupflow.run.end import how_to_resume, stopped_line
from tests.unit.job_loop_fakes import (
    PROMPTS_PER_STEP,
    run_job,
    trained_prompts,
)

CHECKPOINTS = ["trainer.checkpoint_every=4", "trainer.keep_checkpoints=3"]


def stop_at(when: float, deadline_s: float = 60.0, what: str = "stop"):
    """A StopRequest whose `groupflow stop` side asks `what` from virtual time `when` on."""

    def make(clock):
        return StopRequest(
            deadline_s, poll=lambda: what if clock.now >= when else None, clock=lambda: clock.now
        )

    return make


def step_spans(run) -> dict[int, float]:
    """Virtual time each step's learning began, by step."""
    return {e[1]: e[2] for e in run.log if e[0] == "train"}


def saved_state(run_dir, step: int) -> DriverState:
    path = CheckpointStore(run_dir).root / f"step_{step}" / STATE_FILE
    return DriverState.model_validate_json(path.read_text())


def test_a_stop_ends_the_job_after_the_step_in_flight_and_checkpoints_it(tmp_path, caplog):
    """Asked while step 2 waits for its samples: step 2 is trained and recorded, no step
    after it, and its checkpoint is saved off schedule (checkpoint_every=4), at its
    position in the prompt stream."""
    straight = run_job(steps=6)
    learn = step_spans(straight)
    asked = learn[1] + 1.5  # step 1 has learnt (1 s): step 2 waits for its samples
    with caplog.at_level(logging.INFO):
        run = run_job(steps=6, run_dir=tmp_path, overrides=CHECKPOINTS, stop=stop_at(asked))
    assert [r["step"] for r in run.records] == [1, 2]
    assert (
        run.job.stopped
        and run.job.last_step == 2
        and run.job.stopping.request.source == "groupflow stop"
    )
    assert [p.name for p in CheckpointStore(tmp_path).complete()] == ["step_2"]
    state = saved_state(tmp_path, 2)
    assert (state.step, state.policy_version) == (2, 2)
    assert state.parts.prompt_stream == StreamState(consumed=2 * PROMPTS_PER_STEP)
    lines = [r.getMessage() for r in caplog.records]
    assert any(
        line.startswith("groupflow stop: stopping after the step in flight") for line in lines
    )
    assert any(
        line.startswith(f"checkpoint of step 2 saved to {tmp_path / 'checkpoints' / 'step_2'} in ")
        and line.endswith("s")
        for line in lines
    ), lines


def test_a_stopped_job_resumes_to_what_the_straight_one_trains(tmp_path):
    straight = run_job(steps=6, run_dir=tmp_path / "straight", overrides=CHECKPOINTS)
    asked = step_spans(straight)[2] + 1.5  # step 3 is generating
    stopped = run_job(steps=6, run_dir=tmp_path / "cut", overrides=CHECKPOINTS, stop=stop_at(asked))
    resumed = run_job(steps=6, run_dir=tmp_path / "cut", overrides=CHECKPOINTS, resume=True)
    cut = stopped.job.last_step
    assert 2 <= cut < 6 and [r["step"] for r in resumed.records] == list(range(cut + 1, 7))
    assert trained_prompts(stopped) + trained_prompts(resumed) == trained_prompts(straight)
    assert (resumed.learner.weights, resumed.learner.moment) == (
        straight.learner.weights,
        straight.learner.moment,
    )


def test_a_step_whose_samples_are_late_is_abandoned_at_the_deadline(tmp_path):
    """Engines so slow that step 2's samples take 200 s: a stop with a 10 s deadline
    abandons step 2 within the deadline and a heartbeat, and the checkpoint is step 1's,
    at step 1's position in the stream (the prompts drawn for step 2 are drawn again on a
    resume)."""
    slow = dict(seconds_per_prompt=50.0, learn_s=1.0)
    learn = step_spans(run_job(steps=2, **slow))
    asked = learn[1] + 5.0
    run = run_job(
        steps=4,
        run_dir=tmp_path,
        overrides=CHECKPOINTS,
        stop=stop_at(asked, deadline_s=10.0),
        **slow,
    )
    assert [r["step"] for r in run.records] == [1] and len(run.learner.steps) == 1
    assert run.job.stopped and run.job.last_step == 1
    state = saved_state(tmp_path, 1)
    assert state.parts.prompt_stream == StreamState(consumed=PROMPTS_PER_STEP)
    # the save began within the deadline (plus a poll and a heartbeat) of the stop
    saved = next(e[2] for e in run.log if e[:2] == ("get", "save"))
    save_s = 5.0  # the fake learner's
    assert saved - save_s <= asked + 10.0 + 2 * HEARTBEAT_S, (asked, saved)
    assert saved < learn[2]  # long before step 2's samples were in


def test_a_step_that_has_its_samples_finishes_however_late():
    """The deadline bounds the wait for samples only: a stop asked while the learner trains
    (here for 100 s) lets that step finish."""
    learn = step_spans(run_job(steps=2, learn_s=100.0))
    run = run_job(steps=4, learn_s=100.0, stop=stop_at(learn[2] + 1.0, deadline_s=1.0))
    assert [r["step"] for r in run.records] == [1, 2] and run.job.stopped


def test_a_stop_in_the_last_step_lets_the_job_finish():
    learn = step_spans(run_job(steps=3))
    run = run_job(steps=3, stop=stop_at(learn[3] - 0.5))
    assert [r["step"] for r in run.records] == [1, 2, 3]
    assert not run.job.stopped


def test_stop_now_aborts_at_once_writing_nothing_more(tmp_path):
    learn = step_spans(run_job(steps=6))
    with pytest.raises(StopAborted, match="groupflow stop --now: aborted at once"):
        run_job(
            steps=6,
            run_dir=tmp_path,
            overrides=CHECKPOINTS,
            stop=stop_at(learn[1] + 1.5, what="now"),
        )
    assert CheckpointStore(tmp_path).complete() == []


def test_without_a_stop_request_the_job_runs_as_before():
    assert [r["step"] for r in run_job(steps=3, stop=stop_at(float("inf"))).records] == [1, 2, 3]


# ----- signals ---------------------------------------------------------------------------------
@pytest.mark.parametrize("first", [signal.SIGINT, signal.SIGTERM])
def test_a_first_signal_asks_a_stop_and_a_second_aborts(first):
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    stop = StopRequest(60.0)
    with stop_on_signals(stop):
        os.kill(os.getpid(), first)
        assert (
            stop.asked
            and stop.source == {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}[first]
        )
        with pytest.raises(StopAborted, match="Ctrl-C while stopping: aborted at once"):
            os.kill(os.getpid(), signal.SIGINT)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_a_stop_is_overdue_after_its_deadline():
    now = [0.0]
    stop = StopRequest(10.0, clock=lambda: now[0])
    assert not stop.overdue()
    stop.ask("Ctrl-C")
    now[0] = 10.0
    assert not stop.overdue()
    now[0] = 10.5
    assert stop.overdue()


# ----- how a run ended ---------------------------------------------------------------------------
def write_summary(run_dir, **fields):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps({"steps": 20, **fields}))


def write_checkpoint(run_dir, step: int):
    path = CheckpointStore(run_dir).root / f"step_{step}"
    path.mkdir(parents=True)
    parts = Parts(
        prompt_stream=StreamState(consumed=8 * step),
        restarts={},
        reward_totals={},
        held_out={"eval_accuracy": 0.5},
    )
    state = DriverState(
        step=step,
        policy_version=step,
        provenance=Provenance(model_config_json={}, num_ranks=2),
        parts=parts,
    )
    (path / STATE_FILE).write_text(state.model_dump_json())
    return path


def already_finished(resume, steps: int, run_dir):
    """What a resume of `run_dir` finds (groupflow/run/driver.py `run`): the checkpoint asked
    for, read once, and whether the run finished its steps already."""
    found = find_resume(resume, CheckpointStore(run_dir))
    return finished_line(resume, steps, run_dir, found)


@pytest.mark.parametrize("resume", ["latest", "auto"])
def test_a_finished_run_is_said_finished(tmp_path, resume):
    run = tmp_path / "job"
    write_summary(run)  # an older summary: no "stopped" key, every summary was a finished run
    write_checkpoint(run, 20)
    line = already_finished(resume, 20, run)
    assert line.startswith("run job already finished its 20 steps (")
    assert "nothing started" in line and "trainer.steps" in line


def test_a_finished_run_without_checkpoints_is_said_finished_by_its_summary(tmp_path):
    write_summary(tmp_path / "job", stopped=False)
    assert already_finished("auto", 20, tmp_path / "job") is not None
    assert str(tmp_path / "job" / "summary.json") in already_finished("auto", 20, tmp_path / "job")


def test_a_checkpoint_at_the_last_step_is_finished_without_a_summary(tmp_path):
    checkpoint = write_checkpoint(tmp_path / "job", 20)
    assert str(checkpoint) in already_finished("latest", 20, tmp_path / "job")
    assert str(checkpoint) in already_finished(str(checkpoint), 20, tmp_path / "job")


@pytest.mark.parametrize(
    "case", ["stopped", "more_steps", "older_checkpoint", "fresh", "never", "no_run"]
)
def test_a_run_with_training_left_is_not_finished(tmp_path, case):
    run = tmp_path / "job"
    resume, steps = "latest", 20
    if case == "no_run":
        resume = "auto"
    else:
        write_summary(run, stopped=case == "stopped")
        older = write_checkpoint(run, 12)
        if case in ("more_steps", "older_checkpoint"):
            write_checkpoint(run, 20)
        resume = {"older_checkpoint": str(older), "fresh": None, "never": "never"}.get(case, resume)
        steps = 30 if case == "more_steps" else 20
    assert already_finished(resume, steps, run) is None


def test_the_resume_command_repeats_the_command_line():
    assert how_to_resume("my job.yaml", ["trainer.steps=50", "trainer.resume=never"], False) == (
        "groupflow train 'my job.yaml' --set trainer.steps=50 --resume"
    )
    assert how_to_resume(None, [], False) == "groupflow train --resume"
    assert how_to_resume("groupflow-job.yaml", [], True).startswith("groupflow submit")


def test_the_stopped_line_names_what_was_written_and_how_to_go_on():
    summary = {
        "step_reached": 42,
        "steps": 60,
        "stopped_by": "Ctrl-C",
        "run_dir": "runs/job",
        "model_dir": "runs/job/model",
        "checkpoint": "runs/job/checkpoints/step_42",
        "checkpoint_every": 10,
    }
    assert stopped_line(summary, "groupflow train job.yaml --resume") == (
        "stopped at step 42 of 60 (Ctrl-C): wrote checkpoint runs/job/checkpoints/step_42, "
        "model runs/job/model, plots and summary.json in runs/job; resume with: "
        "groupflow train job.yaml --resume"
    )
    no_checkpoints = stopped_line(summary | {"checkpoint": None, "checkpoint_every": 0}, "x")
    assert no_checkpoints.endswith(
        "wrote model runs/job/model, plots and summary.json in runs/job; no checkpoint to "
        "resume from (trainer.checkpoint_every is 0)"
    )


@pytest.mark.parametrize("with_checkpoint", [True, False])
def test_resuming_a_finished_run_says_so_and_starts_nothing(
    tmp_path, capsys, monkeypatch, with_checkpoint
):
    import ray

    import groupflow.run.driver
    from groupflow.run.cli import main

    def started(*args, **kwargs):  # the suite shares one Ray cluster: is_initialized can't tell
        raise AssertionError("a finished run was started again")

    monkeypatch.setattr(groupflow.run.driver, "open_run", started)
    monkeypatch.setattr(ray, "init", started)

    run = tmp_path / "quickstart"
    write_summary(run, steps=3, wall_time_s=12.5)
    if with_checkpoint:
        write_checkpoint(run, 3)
    summary = (run / "summary.json").read_bytes()
    listing = sorted(p.name for p in tmp_path.rglob("*"))
    resume = "--resume" if with_checkpoint else "--resume=auto"
    args = ["train", "--set", f"trainer.output_dir={tmp_path}", "--set", "trainer.steps=3", resume]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("run quickstart already finished its 3 steps (") and out.count("\n") == 1
    assert (run / "summary.json").read_bytes() == summary
    assert sorted(p.name for p in tmp_path.rglob("*")) == listing  # not even a lock file


def test_the_control_actor_keeps_the_stop_and_the_last_line_for_groupflow_stop():
    """What `groupflow stop` and the driver leave on the job's control actor (its class,
    without Ray): a stop, which --now raises to an abort that a later plain stop does not
    lower, and the job's last line, whose reading the driver waits for."""
    from groupflow.actors.control import JobControl
    from groupflow.core.scaling_protocol import ScaleLimits

    control = JobControl(ScaleLimits(True, {}, {}))
    assert control.stop_asked() is None
    control.stop(now=False)
    assert control.stop_asked() == "stop"
    control.stop(now=True)
    control.stop(now=False)
    assert control.stop_asked() == "now"
    assert control.end_line() is None and not control.end_line_read()
    control.end("stopped at step 3 of 5")
    assert not control.end_line_read()
    assert control.end_line() == "stopped at step 3 of 5" and control.end_line_read()


def test_the_drivers_side_of_the_control_actor_is_a_whole_inbox():
    """ActorInbox serves the scaler (groupflow.core.scaling_protocol.Inbox) and the stop alike."""
    from groupflow.actors.control import ActorInbox
    from groupflow.core.scaling_protocol import Inbox

    wanted = {n for n in vars(Inbox) if not n.startswith("_")} | {"stop_asked", "ended"}
    assert all(callable(getattr(ActorInbox, name, None)) for name in wanted), wanted
