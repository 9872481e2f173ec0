"""The experiment trackers write what they are given, and a missing one is a one-line error."""

import random

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from groupflow.observe import trackers
from groupflow.run.job_config import build_config


def _records(n: int) -> list[dict]:
    rng = random.Random()
    return [
        {
            "step": step,
            "reward_mean": rng.random(),
            "num_sequences": rng.randrange(1, 100),
            "task": "arithmetic",  # not a number: metrics.jsonl only
            "clip_low_fraction": float("nan"),  # not finite: left out
            "converged": True,  # a flag, not a figure
        }
        for step in range(1, n + 1)
    ]


def test_tensorboard_gets_every_numeric_figure_per_step(tmp_path):
    cfg = build_config({"metrics": {"loggers": ["tensorboard"]}})
    records = _records(5)
    (tracker,) = trackers.open_trackers(cfg, tmp_path)
    for record in records:
        tracker.write(record)
    tracker.close()

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["num_sequences", "reward_mean"]
    logged = [(e.step, e.value) for e in events.Scalars("reward_mean")]
    assert [s for s, _ in logged] == [r["step"] for r in records]
    assert [v for _, v in logged] == pytest.approx([r["reward_mean"] for r in records], rel=1e-6)


def test_wandb_offline_keeps_the_run_under_the_run_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = build_config({"metrics": {"loggers": ["wandb"], "wandb_mode": "offline"}})
    records = _records(3)
    (tracker,) = trackers.open_trackers(cfg, tmp_path)
    for record in records:
        tracker.write(record)
    summary = dict(tracker.run.summary)
    tracker.close()

    assert summary["reward_mean"] == pytest.approx(records[-1]["reward_mean"])
    assert "task" not in summary and "clip_low_fraction" not in summary
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    assert run_file.stat().st_size > 0


def test_a_tracker_not_installed_is_named(monkeypatch):
    cfg = build_config({"metrics": {"loggers": ["tensorboard", "wandb"]}})
    real = trackers.importlib.util.find_spec
    monkeypatch.setattr(
        trackers.importlib.util, "find_spec", lambda m: None if m == "wandb" else real(m)
    )
    with pytest.raises(trackers.TrackerError, match=r"metrics.loggers: 'wandb' needs .*\[wandb\]"):
        trackers.check_trackers(cfg)


def test_unknown_logger_is_a_config_error():
    with pytest.raises(ValueError, match="metrics.loggers"):
        build_config({"metrics": {"loggers": ["mlflow"]}})
