"""Experiment trackers: the step records of metrics.jsonl, also sent to TensorBoard or Weights &
Biases (`metrics.loggers`).

Each tracker is an optional extra (`pip install 'groupflow[tensorboard]'`, `'groupflow[wandb]'`);
`open_trackers` checks that each one asked for is installed before the job starts its actors, so
a missing one costs a line, not a cluster start-up. Only numbers are logged: the records' other
values (names, lists) belong to metrics.jsonl.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

from groupflow.config import Config

# logger name -> (the module it needs, the extra that installs it)
REQUIREMENTS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


class TrackerError(ValueError):
    """A tracker that cannot start, reported as one line."""


def _scalars(record: dict) -> dict[str, float]:
    return {
        key: float(value)
        for key, value in record.items()
        if isinstance(value, int | float) and not isinstance(value, bool) and key != "step"
        if math.isfinite(value)
    }


class TensorBoardTracker:
    """Event files under `runs/<name>/tensorboard/` (`tensorboard --logdir runs`)."""

    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def write(self, record: dict) -> None:
        for key, value in _scalars(record).items():
            self.writer.add_scalar(key, value, global_step=record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """One W&B run per job, named after it; `metrics.wandb_mode: offline` keeps it on disk under
    `runs/<name>/wandb/` (`wandb sync` uploads it later)."""

    def __init__(self, cfg: Config, run_dir: Path):
        import wandb

        self.run = wandb.init(
            project=cfg.metrics.wandb_project,
            name=cfg.trainer.run_name,
            dir=str(run_dir),
            mode=cfg.metrics.wandb_mode,
            config=cfg.model_dump(mode="json"),
        )

    def write(self, record: dict) -> None:
        self.run.log(_scalars(record), step=record["step"], commit=True)

    def close(self) -> None:
        self.run.finish()


def check_trackers(cfg: Config) -> None:
    """Raise TrackerError naming the first logger whose package is not installed."""
    for name in cfg.metrics.loggers:
        module, extra = REQUIREMENTS[name]
        if importlib.util.find_spec(module) is None:
            raise TrackerError(
                f"metrics.loggers: {name!r} needs the {module} package "
                f"(pip install 'groupflow[{extra}]')"
            )


def open_trackers(cfg: Config, run_dir: Path) -> list[TensorBoardTracker | WandbTracker]:
    check_trackers(cfg)
    makers = {
        "tensorboard": lambda: TensorBoardTracker(run_dir),
        "wandb": lambda: WandbTracker(cfg, run_dir),
    }
    return [makers[name]() for name in cfg.metrics.loggers]
