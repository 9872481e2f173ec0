"""How a run ended, in summary.json and in the line that says so: finished, stopped early
(groupflow/loop/stopping.py), or found finished already by a resume, which then starts nothing."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from groupflow.loop.checkpointer import Resume

SUMMARY_FILE = "summary.json"


def read_summary(run_dir: Path) -> dict | None:
    """The run's summary.json, or None when it has none (or not a readable one)."""
    try:
        summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def _finished_steps(summary: dict | None) -> int | None:
    """The steps a run's summary says it finished, or None for a run that was stopped."""
    if summary is None or summary.get("stopped"):
        return None
    steps = summary.get("steps")
    return steps if isinstance(steps, int) else None


def already_finished(
    resume: str | None, steps: int, run_dir: Path, found: Resume | None
) -> str | None:
    """With a resume asked (`trainer.resume`, which found the checkpoint `found`): one line
    saying the run finished its `steps` already, when that checkpoint is at `steps`, or when
    it resumes the newest and summary.json says the run finished them; None when there is
    training to do (a fresh run, a stopped run, or `trainer.steps` raised). Reads only."""
    if resume in (None, "never"):
        return None
    at_steps = found is not None and found.state.step == steps
    newest = resume in ("auto", "latest")
    done = _finished_steps(read_summary(run_dir))
    if not at_steps and not (newest and done is not None and done >= steps):
        return None
    where = found.checkpoint if at_steps else run_dir / SUMMARY_FILE
    return (
        f"run {run_dir.name} already finished its {steps} steps ({where}): nothing to resume, "
        f"nothing started; to train on, raise trainer.steps (--set trainer.steps=N)"
    )


def how_to_resume(config: str | None, overrides: list[str], submitted: bool) -> str:
    """The command that goes on from a stopped run's newest checkpoint."""
    if submitted:  # a resubmission has trainer.resume: auto
        return "groupflow submit CONFIG (the same config: it goes on from the newest checkpoint)"
    words = ["groupflow", "train"] + ([config] if config else [])
    for override in overrides:
        if not override.startswith("trainer.resume="):
            words += ["--set", override]
    return shlex.join([*words, "--resume"])


def stopped_line(summary: dict, resume_with: str) -> str:
    """What a stopped run wrote, and how to go on."""
    wrote = [f"checkpoint {summary['checkpoint']}"] if summary.get("checkpoint") else []
    wrote += [f"model {summary['model_dir']}", f"plots and {SUMMARY_FILE} in {summary['run_dir']}"]
    if summary.get("checkpoint"):
        then = f"resume with: {resume_with}"
    elif summary.get("checkpoint_every"):
        then = "no step was trained, so there is no checkpoint to resume from"
    else:
        then = "no checkpoint to resume from (trainer.checkpoint_every is 0)"
    return (
        f"stopped at step {summary['step_reached']} of {summary['steps']} "
        f"({summary['stopped_by']}): wrote {', '.join(wrote)}; {then}"
    )
