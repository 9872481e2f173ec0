"""write_plots turns a metrics.jsonl into PNGs, whatever subset of keys the records hold."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from groupflow.observe.catalogue import BY_KEY, RENAMED_KEYS
from groupflow.observe.plots import (
    FIGURES,
    latest_run,
    moving_average,
    panel_keys,
    read_records,
    write_plots,
)
from tests.unit.dashboard_spec import PANEL_ROWS

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def synthetic_record(step: int) -> dict:
    t = step / 10
    return {
        "step": step,
        "reward_mean": 0.2 + 0.01 * step,
        "accuracy": 0.1 + 0.01 * step,
        "entropy_mean": 0.6 - 0.002 * step,
        "entropy_pos": 0.55 - 0.002 * step,
        "entropy_neg": 0.65 - 0.002 * step,
        "spurious_frac": 0.001 * (step % 3),
        "lowprob_frac": 0.3 + 0.02 * math.sin(t),
        "lowprob_grad_share": 0.8 + 0.05 * math.cos(t),
        "cancellation_residual": 0.7 + 0.1 * math.sin(t),
        "clip_frac_low": 0.01,
        "clip_frac_high": 0.02,
        "approx_kl": 1e-3 * step,
        "time_gen_s": 2.0 + 0.1 * math.sin(t),
        "time_learn_s": 1.0,
        "time_step_s": 3.2,
    }


def write_jsonl(path: Path, records: list[dict], tail: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def assert_pngs(paths: list[Path], names: set[str]) -> None:
    assert {p.name for p in paths} == names
    for path in paths:
        data = path.read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 5_000, path


ALL_PLOTS = {"reward.png", "entropy.png", "token_credit.png", "throughput.png"}


def test_every_plot_panel_is_a_catalogue_panel_with_keys():
    for figure in FIGURES:
        for panel in figure.panels:
            assert panel in PANEL_ROWS and panel_keys(panel), (figure.filename, panel)


@pytest.mark.parametrize("steps", [5, 60])  # markers on short runs; moving average on long ones
def test_full_records_give_every_plot(tmp_path, steps):
    metrics = write_jsonl(
        tmp_path / "metrics.jsonl", [synthetic_record(s) for s in range(1, steps + 1)]
    )
    paths = write_plots(metrics, tmp_path / "plots")
    assert_pngs(paths, ALL_PLOTS)
    assert all(p.parent == tmp_path / "plots" for p in paths)


def test_missing_keys_skip_only_what_is_missing(tmp_path):
    records = [{"step": s, "reward_mean": s / 10} for s in range(1, 8)]
    records[3]["entropy_mean"] = 0.5  # one point of one entropy line
    records[4] = {"step": 5}  # a record with nothing to draw
    paths = write_plots(write_jsonl(tmp_path / "m.jsonl", records), tmp_path)
    assert_pngs(paths, {"reward.png", "entropy.png"})


def test_a_line_cut_short_by_a_crash_is_skipped(tmp_path):
    records = [synthetic_record(s) for s in range(1, 4)]
    metrics = write_jsonl(tmp_path / "m.jsonl", records, tail='{"step": 4, "reward_')
    assert_pngs(write_plots(metrics, tmp_path), ALL_PLOTS)


def test_no_records_no_plots(tmp_path):
    assert write_plots(write_jsonl(tmp_path / "m.jsonl", []), tmp_path / "plots") == []


def test_non_finite_values_are_left_out(tmp_path):
    records = [{"step": s, "approx_kl": float("nan") if s == 2 else 0.1} for s in range(1, 5)]
    assert_pngs(
        write_plots(write_jsonl(tmp_path / "m.jsonl", records), tmp_path), {"token_credit.png"}
    )


def test_an_old_run_is_read_under_today_s_keys(tmp_path):
    records = [{"step": 1, "num_stages": 2.0}, {"step": 2, "optimizer_passes": 1.0}]
    got = read_records(write_jsonl(tmp_path / "m.jsonl", records))
    assert [r["optimizer_passes"] for r in got] == [2.0, 1.0]
    assert not any("num_stages" in r for r in got)
    # every old key names a figure of today's catalogue, and none is one itself
    assert set(RENAMED_KEYS.values()) <= set(BY_KEY) and not set(RENAMED_KEYS) & set(BY_KEY)


def test_moving_average_averages_the_last_window():
    assert moving_average([1, 2, 3, 4, 5], 2) == [1, 1.5, 2.5, 3.5, 4.5]
    assert moving_average([4.0], 5) == [4.0]


def test_only_the_last_of_several_appended_runs_is_drawn():
    first = [{"step": s, "reward_mean": 0.1} for s in range(1, 6)]
    second = [{"step": s, "reward_mean": 0.9} for s in range(1, 4)]
    assert latest_run(first + second) == second
    assert latest_run(first) == first
    assert latest_run([]) == []


def test_per_task_figures_draw_a_line_per_task(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from groupflow.observe import plots

    records = [
        {**synthetic_record(s), "task_reward_mean": {"math": 0.1 * s, "code": 0.2}} for s in (1, 2)
    ]
    records.append({**synthetic_record(3), "task_reward_mean": {"math": float("nan")}})
    lines = plots._lines(records, "task_reward_mean")
    assert lines == {
        "task_reward_mean[math]": ([1, 2], [0.1, 0.2]),
        "task_reward_mean[code]": ([1, 2], [0.2, 0.2]),
    }
    paths = write_plots(write_jsonl(tmp_path / "metrics.jsonl", records), tmp_path)
    assert_pngs(paths, ALL_PLOTS)
