"""A job's config built for use: a YAML file (or a dict) plus `--set` overrides, the algorithm
preset beneath the algorithm section, the schema's validation, then `resolve`.

`resolve` is the one step after validation: it checks names against the registries of the
extension points (tasks and their options, built-in tools) and fills, once, the settings that
other settings decide when they are left unset (`DERIVED`). Every loader here returns a resolved
config, and a run checks that it got one (`check_resolved`). The section models check only
their own values and import no registry; this module imports the registries inside the
functions that consult them, so that importing a model loads nothing of the wings.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from groupflow.config.algorithm import AlgorithmConfig
from groupflow.config.base import ConfigError
from groupflow.config.bounded_yaml import parse_yaml, read_config_text
from groupflow.config.job import Config, check_response_limit
from groupflow.config.presets import PRESETS
from groupflow.config.task import TaskConfig
from groupflow.config.trainer import TrainerConfig
from groupflow.errors import first_line

QUICKSTART = Path(__file__).parent.parent / "quickstart.yaml"

# YAML 1.1 reads these as booleans; on a command line they are far more often names
# (`--set trainer.run_name=off`). true/false still give booleans.
_YAML11_BOOL_WORDS = {"on", "off", "yes", "no", "y", "n"}

# The settings `resolve` fills when they are left unset, and what decides them there.
DERIVED = {
    "rollout.partial_rollout": "on when trainer.max_staleness > 0",
    "algorithm.off_policy.mode": "tis when trainer.max_staleness > 0, else none",
    "agent.tools": "the task's own tools, where it has any",
}


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (['a','b','c'], parsed value); the value is read as YAML."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r}: expected key.path=value")
    value = value.strip()
    if value.lower() in _YAML11_BOOL_WORDS:
        return key.strip().split("."), value
    try:
        parsed = parse_yaml(value) if value else None
    except yaml.YAMLError as err:
        raise ConfigError(
            f"--set {key.strip()}: the value is not valid YAML ({first_line(err)})"
        ) from None
    return key.strip().split("."), parsed


def _set_path(tree: dict, path: list[str], value: Any) -> None:
    node = tree
    for i, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(path[: i + 1])}: is a value, not a section")
        node = child
    node[path[-1]] = value


def _merge(base: dict, top: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _format_error(err: ValidationError) -> str:
    first = err.errors()[0]
    key = ".".join(str(p) for p in first["loc"]) or "config"
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    elif "input" in first and not isinstance(first["input"], dict):
        msg += f" (got {_describe_input(first['input'])})"
    return f"{key}: {msg}"


def _describe_input(value: Any) -> str:
    if isinstance(value, int) and value.bit_length() > 128:  # repr() refuses the longest
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 100 else text[:100] + "..."


def _task_list_as_mixture(tree: dict) -> dict:
    """`task: [{name: math, weight: 3}, ...]` is short for the built-in task `mixture` with
    that list as its options (several tasks in one job, reward_workers/tasks/mixture.py)."""
    if isinstance(tree.get("task"), list):
        tree["task"] = {"name": "mixture", "options": {"tasks": tree["task"]}}
    return tree


def build_config(raw: dict | None = None, overrides: list[str] = ()) -> Config:
    """Validate a raw dict plus `--set` overrides, the algorithm preset filling in defaults;
    the config returned is resolved."""
    tree = _task_list_as_mixture(copy.deepcopy(raw or {}))
    for text in overrides:
        path, value = parse_override(text)
        _set_path(tree, path, value)
        _task_list_as_mixture(tree)  # `--set task=[...]` then `--set task.eval_size=...`
    algorithm = tree.get("algorithm", {})
    if isinstance(algorithm, dict):
        preset = algorithm.get("preset", AlgorithmConfig.model_fields["preset"].default)
        if isinstance(preset, str) and preset in PRESETS:
            tree["algorithm"] = _merge(PRESETS[preset], algorithm)
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None
    return resolve(cfg)


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
    return build_config(_named_after_file(raw, path), overrides)


def _named_after_file(raw: dict, path: Path) -> dict:
    """A file that leaves trainer.run_name unset names its run after itself (job.yaml: job),
    so that two users' jobs, or a job and the quickstart, never share a run directory or
    resume each other's checkpoints."""
    trainer = raw.get("trainer", {})
    if not isinstance(trainer, dict) or "run_name" in trainer:
        return raw  # a malformed section is the schema's to refuse
    name = path.stem.lstrip(".") or TrainerConfig.model_fields["run_name"].default
    return {**raw, "trainer": {**trainer, "run_name": name}}


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
    return build_config(_merge(limits, _task_list_as_mixture(copy.deepcopy(raw or {}))), overrides)


# ----- resolve ---------------------------------------------------------------------------------
def resolve(cfg: Config) -> Config:
    """Check `cfg`'s names against the registries, then fill its `DERIVED` settings where they
    are unset; in place, and `cfg` is returned. Resolving a resolved config changes nothing.
    A problem is a ConfigError naming its key, as the schema's are."""
    from groupflow.reward_workers.tasks import TASKS, task_class
    from groupflow.rollout.tools import BUILTIN_TOOLS

    for i, held_out in enumerate(cfg.task.eval_sets):
        if held_out.task not in TASKS or held_out.task == "mixture":
            choices = sorted(set(TASKS) - {"mixture"})
            raise ConfigError(
                f"task.eval_sets.{i}: unknown task {held_out.task!r}; choose one of {choices}"
            )
    entries = _mixture_entries(cfg.task)
    for tool in cfg.agent.tools or ():
        if tool not in BUILTIN_TOOLS and ":" not in tool:
            raise ConfigError(
                f"agent.tools: {tool!r} is neither a built-in tool ({', '.join(BUILTIN_TOOLS)}) "
                f"nor 'module:name' of your own (got {_describe_input(cfg.agent.tools)})"
            )
    for entry in entries:
        if entry.max_tokens is not None:
            try:
                check_response_limit(cfg, f"task {entry.label}: max_tokens", entry.max_tokens)
            except ValueError as err:
                raise ConfigError(f"config: {err}") from None
    _check_task_options(cfg.task)

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
    changed = [key for key in DERIVED if _setting(again, key) != _setting(cfg, key)]
    if changed:
        raise RuntimeError(
            f"the config was not resolved: groupflow.config.resolve would set {', '.join(changed)}"
        )


def _setting(cfg: Config, key: str) -> Any:
    value: Any = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def resolved_yaml(cfg: Config) -> str:
    """A run's config.resolved.yaml: the resolved config with every key explicit (it loads
    back to the same job), headed by the settings that `resolve` decides when unset."""
    lines = [
        "# This run's config: defaults, the file and --set, resolved. The settings that others",
        "# decide when left unset (groupflow/config/load.py: resolve) came out as:",
    ]
    for key, rule in DERIVED.items():
        lines.append(f"#   {key}: {json.dumps(_setting(cfg, key))} (unset: {rule})")
    return "\n".join(lines) + "\n" + cfg.dump_yaml()


def _mixture_entries(task: TaskConfig) -> list:
    """A mixture's task list, checked (none for a single task)."""
    if task.name != "mixture":
        return []
    from groupflow.reward_workers.tasks.mixture import mixture_entries

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
    from groupflow.reward_workers.tasks import check_options

    try:
        for name, options, where in task_option_sets(task):
            check_options(name, options, where)
    except ValueError as err:
        raise ConfigError(str(err)) from None
