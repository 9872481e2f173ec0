"""A job's config as a run takes it: read (groupflow/config/load.py), then resolved against
the registries of the wings (the tasks, the built-in tools), the one step that checks names and
fills the settings that others decide when unset (`DERIVED`). Every loader here returns a
resolved config; where a run starts, `check_resolved` refuses one that is not.

The config's models (groupflow/config/) import none of the wings; this module, above them,
is where the two meet.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from groupflow.config import QUICKSTART, Config, ConfigError, TaskConfig
from groupflow.config.bounded_yaml import parse_yaml, read_config_text
from groupflow.config.job import check_response_limit
from groupflow.config.load import (
    DERIVED,
    describe_input,
    merge_trees,
    named_after_file,
    setting_of,
    task_list_as_mixture,
    validate_config,
)
from groupflow.core.errors import first_line
from groupflow.reward_workers.tasks import TASKS, check_options, is_task, own_harness, task_class
from groupflow.reward_workers.tasks.mixture import mixture_entries
from groupflow.rollout.tools import BUILTIN_TOOLS


def build_config(raw: dict | None = None, overrides: list[str] = ()) -> Config:
    """Validate a raw dict plus `--set` overrides, the algorithm preset filling in defaults;
    the config returned is resolved."""
    return resolve(validate_config(raw, overrides))


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Load a YAML config (None = the built-in quickstart job) and apply overrides; the config
    returned is resolved."""
    path = Path(path) if path is not None else QUICKSTART
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        raw = parse_yaml(read_config_text(path)) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({first_line(err)})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return build_config(named_after_file(raw, path), overrides)


def small_model_config(raw: dict | None = None, overrides: list[str] = ()) -> Config:
    """A job from the schema's defaults with quickstart.yaml's engine limits
    (rollout.max_model_len and rollout.sampling.max_tokens) beneath `raw`: the defaults fit a
    real model's context, past the 256 positions of the built-in small model, which the tests
    and benchmarks that start engines on it build their jobs on."""
    rollout = parse_yaml(read_config_text(QUICKSTART))["rollout"]
    limits = {
        "rollout": {
            "max_model_len": rollout["max_model_len"],
            "sampling": {"max_tokens": rollout["sampling"]["max_tokens"]},
        }
    }
    return build_config(
        merge_trees(limits, task_list_as_mixture(copy.deepcopy(raw or {}))), overrides
    )


def resolve(cfg: Config) -> Config:
    """Check `cfg`'s names against the registries, then fill its `DERIVED` settings where they
    are unset; in place, and `cfg` is returned. Resolving a resolved config changes nothing.
    A problem is a ConfigError naming its key, as the schema's are."""
    for i, held_out in enumerate(cfg.task.eval_sets):
        if not is_task(held_out.task) or held_out.task == "mixture":
            choices = sorted(set(TASKS) - {"mixture"})
            raise ConfigError(
                f"task.eval_sets.{i}: unknown task {held_out.task!r}; choose one of {choices}"
            )
    entries = _mixture_entries(cfg.task)
    for tool in cfg.agent.tools or ():
        if tool not in BUILTIN_TOOLS and ":" not in tool:
            raise ConfigError(
                f"agent.tools: {tool!r} is neither a built-in tool ({', '.join(BUILTIN_TOOLS)}) "
                f"nor 'module:name' of your own (got {describe_input(cfg.agent.tools)})"
            )
    for entry in entries:
        if entry.max_tokens is not None:
            try:
                check_response_limit(cfg, f"task {entry.label}: max_tokens", entry.max_tokens)
            except ValueError as err:
                raise ConfigError(f"config: {err}") from None
    _check_task_options(cfg.task)
    _set_task_harness(cfg, entries)

    stale = cfg.trainer.max_staleness > 0
    if "partial_rollout" not in cfg.rollout.model_fields_set or cfg.rollout.partial_rollout is None:
        cfg.rollout.partial_rollout = stale
    off_policy = cfg.algorithm.off_policy
    if "mode" not in off_policy.model_fields_set and stale:
        # Stale samples come from a policy the learner no longer holds: correct by default.
        off_policy.mode = "tis"
    if cfg.agent.tools is None:
        # A task without tools leaves the key unset, which then means none.
        cfg.agent.tools = list(getattr(task_class(cfg.task.name), "TOOLS", ())) or None
    return cfg


def check_resolved(cfg: Config) -> None:
    """Where a run starts (train, eval, a dry run): `cfg` must be what `resolve` makes of it,
    as every loader here returns. A config built another way (Config(...), model_validate)
    that resolve would change is a bug, stopped before anything starts."""
    again = resolve(cfg.model_copy(deep=True))
    changed = [key for key in DERIVED if setting_of(again, key) != setting_of(cfg, key)]
    if changed:
        raise RuntimeError(
            f"the config was not resolved: groupflow.run.job_config.resolve would set {', '.join(changed)}"
        )


def _set_task_harness(cfg: Config, entries: list) -> None:
    """A task that plays its trajectories with its own program (a multi-turn verifiers
    taskset) names it in agent.harness where that is unset; it trains alone, since a job's
    trajectories all run one harness."""
    try:
        for i, entry in enumerate(entries):
            if own_harness(entry.name, entry.options) is not None:
                raise ValueError(
                    f"task[{i}]: {entry.name} is played by its own program, which runs all of "
                    "a job's trajectories: it trains alone (task.name), not in a mixture"
                )
        harness = None if entries else own_harness(cfg.task.name, cfg.task.options)
    except ValueError as err:
        raise ConfigError(first_line(err)) from None
    if harness is None or cfg.agent.harness == harness:
        return
    driver = "environment" if cfg.agent.environment is not None else "harness"
    if driver == "environment" or cfg.agent.harness is not None:
        raise ConfigError(
            f"agent.{driver}: task {cfg.task.name} is played by its own program ({harness}); "
            f"unset agent.{driver}"
        )
    cfg.agent.harness = harness


def _mixture_entries(task: TaskConfig) -> list:
    """A mixture's task list, checked (none for a single task)."""
    if task.name != "mixture":
        return []
    try:
        return mixture_entries(task.options.get("tasks"))
    except ValueError as err:
        raise ConfigError(f"task: {err}") from None


def task_option_sets(task: TaskConfig) -> list[tuple[str, dict[str, Any], str]]:
    """(task name, its options, where they are in the config) for the job's task (each of a
    mixture's tasks) and each held-out set; the options are the config's own dicts."""
    if task.name == "mixture":
        # Named as written: `task: [{name: math, options: {...}}, ...]`
        entries = _mixture_entries(task)
        named = [(e.name, e.options, f"task[{i}].options") for i, e in enumerate(entries)]
    else:
        named = [(task.name, task.options, "task.options")]
    for i, held_out in enumerate(task.eval_sets):
        named.append((held_out.task, held_out.options, f"task.eval_sets[{i}].options"))
    return named


def _check_task_options(task: TaskConfig) -> None:
    """Each task's options (a mixture's, each of its tasks'; each held-out set's) against the
    options that task declares: a misspelt or ill-typed one is a ConfigError naming its key,
    here rather than when the task is built on the cluster."""
    try:
        for name, options, where in task_option_sets(task):
            check_options(name, options, where)
    except ValueError as err:
        raise ConfigError(str(err)) from None
