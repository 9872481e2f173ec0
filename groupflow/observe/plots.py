"""PNG plots of a run's metrics.jsonl: reward, entropy, the token-credit diagnostics and the
stage times, one subplot per panel of the metric catalogue."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on cluster nodes or in CI

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from groupflow.observe.catalogue import BY_KEY, METRICS, with_current_keys  # noqa: E402


@dataclass(frozen=True)
class Figure:
    filename: str
    title: str
    panels: tuple[str, ...]  # catalogue panels (groupflow/observe/catalogue.py), one subplot each


FIGURES = (
    Figure(
        "reward.png", "Reward, accuracy and learning rate", ("Reward", "Accuracy", "Learning rate")
    ),
    Figure("entropy.png", "Token entropy", ("Entropy",)),
    Figure(
        "token_credit.png",
        "Token-credit diagnostics",
        (
            "Spurious and low-probability tokens",
            "Cancellation residual",
            "Clip fractions",
            "Approx. KL",
            "Off-policy correction",
        ),
    ),
    Figure(
        "throughput.png",
        "Stage times and throughput",
        ("Mean stage latency and step time", "Tokens per second by stage", "Staleness"),
    ),
)

# Grafana draws this count as a rate; on a plot, its panel's tokens-per-second lines say it.
_NOT_PLOTTED = {"tokens_generated"}


def panel_keys(panel: str) -> tuple[str, ...]:
    """The record keys a panel draws, in catalogue order."""
    return tuple(m.key for m in METRICS if m.panel == panel and m.key not in _NOT_PLOTTED)


def panel_unit(panel: str) -> str:
    return BY_KEY[panel_keys(panel)[0]].unit if panel_keys(panel) else ""


def read_records(metrics_jsonl: Path) -> list[dict]:
    """The step records, under today's keys (an old run's renamed keys too); a line cut short
    by a crash (or otherwise unreadable) is skipped."""
    records = []
    for line in metrics_jsonl.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(with_current_keys(record))
    return records


def latest_run(records: list[dict]) -> list[dict]:
    """The records of the last run: metrics.jsonl is appended to, so a run started again in
    the same directory follows the previous one, and its steps start over."""
    start = 0
    for i in range(1, len(records)):
        step, previous = records[i].get("step"), records[i - 1].get("step")
        if isinstance(step, int | float) and isinstance(previous, int | float) and step <= previous:
            start = i
    return records[start:]


def _lines(records: list[dict], key: str) -> dict[str, tuple[list[float], list[float]]]:
    """name -> (steps, values) of the records that hold a finite number under `key`; a key
    whose values are per-label mappings (catalogue Series.label) gives a line per label."""
    lines: dict[str, tuple[list[float], list[float]]] = {}
    for index, record in enumerate(records, start=1):
        value = record.get(key)
        points = value.items() if isinstance(value, dict) else [(None, value)]
        for label, number in points:
            if isinstance(number, int | float) and math.isfinite(number):
                steps, values = lines.setdefault(
                    key if label is None else f"{key}[{label}]", ([], [])
                )
                steps.append(record.get("step", index))
                values.append(number)
    return lines


# Up to this many points a line gets markers; beyond, it is drawn faintly under its moving
# average, because per-step RL figures are noisy and the trend is what a reader looks for.
FEW_POINTS = 30


def moving_average(values: list[float], window: int) -> list[float]:
    """Mean of the last `window` values at each point (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def _plot_series(ax, steps: list[float], values: list[float], key: str) -> None:
    if len(values) <= FEW_POINTS:
        ax.plot(steps, values, label=key, marker="o", markersize=3)
        return
    window = max(5, len(values) // 10)
    (raw,) = ax.plot(steps, values, alpha=0.3, linewidth=1)
    smooth = moving_average(values, window)
    ax.plot(steps, smooth, color=raw.get_color(), label=f"{key} (mean of {window})")


def _draw_panel(ax, records: list[dict], panel: str) -> None:
    for key in panel_keys(panel):
        for name, (steps, values) in _lines(records, key).items():
            _plot_series(ax, steps, values, name)
    ax.set_title(panel)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no step 1.5 on short runs
    ax.set_ylabel(panel_unit(panel))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def _has_data(records: list[dict], panel: str) -> bool:
    return any(_lines(records, key) for key in panel_keys(panel))


def _write_figure(records: list[dict], figure: Figure, out_dir: Path) -> Path | None:
    panels = [panel for panel in figure.panels if _has_data(records, panel)]
    if not panels:
        return None
    columns = min(len(panels), 3)
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(
        rows, columns, figsize=(max(5 * columns, 7), 3.6 * rows), squeeze=False
    )
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        _draw_panel(ax, records, panel)
    fig.suptitle(figure.title)
    fig.tight_layout()
    path = out_dir / figure.filename
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(metrics_jsonl: Path, out_dir: Path) -> list[Path]:
    """Write the PNGs for the metrics present in `metrics_jsonl`; returns the files written.

    Only the last run in the file is drawn. A figure none of whose keys appear is skipped, and
    so is a line with none of its points.
    """
    records = latest_run(read_records(Path(metrics_jsonl)))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = (_write_figure(records, figure, out_dir) for figure in FIGURES)
    return [path for path in written if path is not None]
