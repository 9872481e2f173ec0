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
from types import UnionType
from typing import Any, Union, get_origin

import yaml
from pydantic import ValidationError

from groupflow.config.algorithm import AlgorithmConfig
from groupflow.config.base import ConfigError
from groupflow.config.bounded_yaml import parse_yaml
from groupflow.config.job import Config
from groupflow.config.presets import PRESETS
from groupflow.config.trainer import TrainerConfig
from groupflow.core.errors import first_line

QUICKSTART = Path(__file__).parent.parent / "quickstart.yaml"

# YAML 1.1 reads these as booleans; on a command line they are far more often names
# (`--set trainer.run_name=off`). true/false still give booleans.
_YAML11_BOOL_WORDS = {"on", "off", "yes", "no", "y", "n"}

# The settings `resolve` fills when they are left unset, and what decides them there.
DERIVED = {
    "rollout.partial_rollout": "on when trainer.max_staleness > 0",
    "algorithm.off_policy.mode": "tis when trainer.max_staleness > 0, else none",
    "agent.tools": "the task's own tools, where it has any",
    "agent.harness": "a multi-turn verifiers taskset's own program, for task.name: verifiers:...",
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


def merge_trees(base: dict, top: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_trees(out[key], value)
        else:
            out[key] = value
    return out


def _format_error(err: ValidationError) -> str:
    errors = err.errors()
    first = errors[0]
    branches = _union_branches(errors)
    loc = first["loc"][:-1] if branches else first["loc"]
    key = ".".join(str(p) for p in loc) or "config"
    msg = first["msg"].removeprefix("Value error, ")
    if branches:  # one line for the whole union: what each of its types would have taken
        msg = "; or ".join([msg, *(b["msg"].removeprefix("Input should be ") for b in branches)])
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    elif "input" in first and not isinstance(first["input"], dict):
        msg += f" (got {describe_input(first['input'])})"
    return f"{key}: {msg}"


def _union_branches(errors: list) -> list:
    """The other branches' errors when the first error is one branch of a setting typed as a
    union (`StrictBool | Literal["auto"]`): pydantic then reports one error per type, each at
    the setting's path plus the type's tag (`learner.gradient_checkpointing.bool`). A tag is
    told from a field by the path: its parent resolves to a leaf setting of the schema."""
    first = errors[0]
    parent = first["loc"][:-1]
    if not parent or get_origin(_leaf_annotation(parent)) not in (Union, UnionType):
        return []
    return [e for e in errors[1:] if e["loc"][:-1] == parent]


def _leaf_annotation(loc: tuple) -> Any:
    """The annotation of the setting at `loc` when it is a leaf (not a section), else None."""
    model: Any = Config
    for part in loc:
        fields = getattr(model, "model_fields", None)
        if not isinstance(part, str) or fields is None or part not in fields:
            return None
        model = fields[part].annotation
    return None if hasattr(model, "model_fields") else model


def describe_input(value: Any) -> str:
    if isinstance(value, int) and value.bit_length() > 128:  # repr() refuses the longest
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 100 else text[:100] + "..."


def task_list_as_mixture(tree: dict) -> dict:
    """`task: [{name: math, weight: 3}, ...]` is short for the built-in task `mixture` with
    that list as its options (several tasks in one job, reward_workers/tasks/mixture.py)."""
    if isinstance(tree.get("task"), list):
        tree["task"] = {"name": "mixture", "options": {"tasks": tree["task"]}}
    return tree


def validate_config(raw: dict | None = None, overrides: list[str] = ()) -> Config:
    """Validate a raw dict plus `--set` overrides, the algorithm preset filling in defaults.
    The config is not resolved yet: groupflow/run/job_config.py's `build_config` resolves it."""
    tree = task_list_as_mixture(copy.deepcopy(raw or {}))
    for text in overrides:
        path, value = parse_override(text)
        _set_path(tree, path, value)
        task_list_as_mixture(tree)  # `--set task=[...]` then `--set task.eval_size=...`
    algorithm = tree.get("algorithm", {})
    if isinstance(algorithm, dict):
        preset = algorithm.get("preset", AlgorithmConfig.model_fields["preset"].default)
        if isinstance(preset, str) and preset in PRESETS:
            tree["algorithm"] = merge_trees(PRESETS[preset], algorithm)
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None
    return cfg


def named_after_file(raw: dict, path: Path) -> dict:
    """A file that leaves trainer.run_name unset names its run after itself (job.yaml: job),
    so that two users' jobs, or a job and the quickstart, never share a run directory or
    resume each other's checkpoints."""
    trainer = raw.get("trainer", {})
    if not isinstance(trainer, dict) or "run_name" in trainer:
        return raw  # a malformed section is the schema's to refuse
    name = path.stem.lstrip(".") or TrainerConfig.model_fields["run_name"].default
    return {**raw, "trainer": {**trainer, "run_name": name}}


def setting_of(cfg: Config, key: str) -> Any:
    value: Any = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def resolved_yaml(cfg: Config) -> str:
    """A run's config.resolved.yaml: the resolved config with every key explicit (it loads
    back to the same job), headed by the settings that `resolve` decides when unset."""
    lines = [
        "# This run's config: defaults, the file and --set, resolved. The settings that others",
        "# decide when left unset (groupflow/run/job_config.py: resolve) came out as:",
    ]
    for key, rule in DERIVED.items():
        lines.append(f"#   {key}: {json.dumps(setting_of(cfg, key))} (unset: {rule})")
    return "\n".join(lines) + "\n" + cfg.dump_yaml()
