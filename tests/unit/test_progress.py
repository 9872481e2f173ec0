"""The driver's progress lines: long phases (groupflow/observe/progress.py) and the step line's elapsed
time and ETA (groupflow/observe/metrics.py), off a terminal, on a fake clock."""

from __future__ import annotations

import logging
import threading

import pytest

from groupflow.observe.driver_log import FILE_ONLY
from groupflow.observe.metrics import RECENT_STEPS, ProgressReporter
from groupflow.observe.progress import PhaseProgress, clock_text, heartbeat
from groupflow.run.job_config import load_config


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    "seconds, text",
    [(0, "0:00"), (59.4, "0:59"), (59.6, "1:00"), (754, "12:34"), (3600, "1:00:00"), (-3, "0:00")],
)
def test_clock_text(seconds, text):
    assert clock_text(seconds) == text


def test_a_counted_phase_says_where_it_is_at_most_every_interval_with_what_is_left():
    clock, lines = FakeClock(), []
    progress = PhaseProgress("warm start", 200, "steps", every_s=15, clock=clock, say=lines.append)
    for step in range(1, 201):  # a step every 0.5 s: 100 s in all
        clock.now += 0.5
        progress.update(step, f"loss {1 / step:.3f}")
    progress.close()
    # a line every 15 s (30 steps), never more often, and the closing line
    assert lines[0] == "warm start: 30/200 steps, loss 0.033, 0:15 elapsed, about 1:25 left"
    assert lines[1] == "warm start: 60/200 steps, loss 0.017, 0:30 elapsed, about 1:10 left"
    assert len(lines) == 100 // 15 + 1
    assert lines[-1] == "warm start: 200/200 steps in 1:40"


def test_a_short_phase_says_nothing():
    clock, lines = FakeClock(), []
    progress = PhaseProgress("engines", 2, "up", every_s=15, clock=clock, say=lines.append)
    for done in (0, 1, 2):
        clock.now += 4
        progress.update(done)
    progress.close()
    assert lines == []


def test_a_phase_that_took_the_interval_says_so_at_its_end_even_unticked():
    clock, lines = FakeClock(), []
    progress = PhaseProgress("held-out evaluation", every_s=15, clock=clock, say=lines.append)
    clock.now += 20
    progress.close()
    assert lines == ["held-out evaluation: done in 0:20"]


def test_an_uncounted_phase_says_what_it_does_and_its_elapsed_time():
    clock, lines = FakeClock(), []
    progress = PhaseProgress("evaluation", every_s=10, clock=clock, say=lines.append)
    progress.update(note="starting the engine")
    clock.now += 12
    progress.tick()
    progress.update(note="greedy answers to 64 prompts")  # said at the next interval
    clock.now += 9
    progress.tick()
    clock.now += 1
    progress.tick()
    assert lines == [
        "evaluation: starting the engine, 0:12 elapsed",
        "evaluation: greedy answers to 64 prompts, 0:22 elapsed",
    ]


def test_a_heartbeat_says_while_the_phase_blocks_and_ends_only_a_phase_that_ended_well():
    said = threading.Event()
    lines = []

    def say(line):
        lines.append(line)
        said.set()

    with heartbeat(PhaseProgress("evaluation", every_s=0.0, say=say), poll_s=0.01):
        assert said.wait(5.0)  # the block blocks; the thread says
    assert lines[-1].startswith("evaluation: done in ")

    lines.clear()
    with pytest.raises(RuntimeError):
        with heartbeat(PhaseProgress("evaluation", every_s=3600.0, say=say), poll_s=0.01):
            raise RuntimeError("an engine died")
    assert lines == []


def _record(step: int) -> dict:
    return dict(
        step=step, reward_mean=0.5, entropy_mean=0.25, gen_tokens_per_s=812.4, time_step_s=1.1
    )


def test_the_step_line_has_the_elapsed_time_and_an_eta_from_recent_steps(capsys, caplog):
    cfg = load_config(None, ["trainer.steps=40"])
    clock = FakeClock()
    with caplog.at_level(logging.INFO, logger=FILE_ONLY.name):
        FILE_ONLY.addHandler(caplog.handler)  # FILE_ONLY does not propagate: driver.log alone
        try:
            with ProgressReporter(cfg, clock=clock) as progress:
                for step in range(1, 16):  # 2 s a step, then 10 s a step
                    clock.now += 2.0 if step <= 5 else 10.0
                    progress.write(_record(step))
        finally:
            FILE_ONLY.removeHandler(caplog.handler)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 15  # one plain line a step, off a terminal
    assert lines[0] == (
        "step 1/40 reward=0.500 entropy=0.250 tok/s=812 step=1.1s elapsed=0:02 eta=1:18"
    )
    # step 6: the mean of 2, 2, 2, 2, 2, 10 s over the 34 steps left
    assert lines[5].endswith(f"elapsed=0:20 eta={clock_text(34 * 20 / 6)}")
    # step 15: the last RECENT_STEPS steps were all 10 s; the early 2 s ones are forgotten
    assert RECENT_STEPS == 10
    assert lines[14].endswith("elapsed=1:50 eta=4:10")
    # the same lines, for driver.log
    assert [r.getMessage() for r in caplog.records] == lines


def test_the_last_step_has_nothing_left():
    clock = FakeClock()
    with ProgressReporter(load_config(None, ["trainer.steps=2"]), clock=clock) as progress:
        clock.now += 3
        assert progress.line(_record(1)).endswith("elapsed=0:03 eta=0:03")
        clock.now += 3
        assert progress.line(_record(2)).endswith("elapsed=0:06 eta=0:00")


def test_the_warm_start_says_how_far_it_has_got_off_a_terminal(monkeypatch, caplog):
    import groupflow.observe.progress as progress
    from groupflow.core.random_model import random_causal_lm
    from groupflow.reward_workers.tasks import make_task
    from groupflow.run.quickstart import build_tokenizer, warm_start

    monkeypatch.setattr(progress, "EVERY_S", 0.0)  # a line per step
    tokenizer = build_tokenizer()
    model = random_causal_lm(len(tokenizer), seed=0)  # a small one: quick
    with caplog.at_level(logging.INFO, logger="groupflow"):
        warm_start(model, tokenizer, make_task("arithmetic", {}), steps=3)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warm start")]
    assert [line.split(",")[0] for line in lines[:-1]] == [
        "warm start: 1/3 steps",
        "warm start: 2/3 steps",
        "warm start: 3/3 steps",
    ]
    assert lines[-1].startswith("warm start: 3/3 steps in ")
    assert "loss " in lines[0] and "elapsed" in lines[0] and "left" in lines[0]


def test_a_resumed_runs_bar_starts_at_its_step():
    with ProgressReporter(load_config(None, ["trainer.steps=60"])) as progress:
        progress.interactive = True  # as on a terminal
        progress.write(_record(41))
        assert (progress.bar.n, progress.bar.total) == (41, 60)
