"""The paths of a job config made fit for a cluster, before `groupflow submit` sends it.

A submitted job runs in a temporary working directory on the cluster (groupflow/run/jobs.py), so
a relative path there means nothing the user meant. A relative input path (the model, a
dataset, a chat template, a plugin, tool or environment file, a checkpoint to resume from)
that exists here is sent as this machine's absolute path, which the cluster's nodes must be
able to read (shared storage); one that is plainly a path but not here is refused. A relative
`model.path` or dataset that is not here is sent as it is: it may be a Hugging Face id. A
relative `trainer.output_dir` is refused: the run would be written into the temporary
directory and deleted with it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from groupflow.config import Config, ConfigError
from groupflow.core.user_code import spec_file
from groupflow.reward_workers.tasks.prompt_pool import DATASET_OPTIONS
from groupflow.run.job_config import task_option_sets

# trainer.resume's values that are not a checkpoint directory
RESUME_WORDS = ("never", "auto", "latest")
# What a file of a config is named like: such a name is a path, never a hub id.
FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".csv", ".py", ".jinja", ".jinja2")


@dataclass
class InputPath:
    key: str  # where it is in the config, as errors name it
    path: str
    replace: Callable[[str], None]  # writes another path in its place in the config
    may_be_a_hub_id: bool = False


def input_paths(cfg: Config) -> list[InputPath]:
    """Every local path the job reads, with where it is in the config."""
    found: list[InputPath] = []
    if cfg.model.path is not None:
        found.append(
            InputPath("model.path", cfg.model.path, lambda p: setattr(cfg.model, "path", p), True)
        )
    if cfg.task.chat_template not in ("auto", "none"):
        found.append(
            InputPath(
                "task.chat_template",
                cfg.task.chat_template,
                lambda p: setattr(cfg.task, "chat_template", p),
            )
        )
    for _, options, where in task_option_sets(cfg.task):
        for key in DATASET_OPTIONS:
            if isinstance(options.get(key), str):
                found.append(InputPath(f"{where}.{key}", options[key], _setter(options, key), True))
    if cfg.reward.verifier is not None:
        found += _spec_path("reward.verifier", cfg.reward.verifier, cfg.reward, "verifier")
    for i, tool in enumerate(cfg.agent.tools or ()):
        found += _spec_path(f"agent.tools[{i}]", tool, cfg.agent.tools, i)
    for slot in ("environment", "harness"):
        spec = getattr(cfg.agent, slot)
        if spec is not None:
            found += _spec_path(f"agent.{slot}", spec, cfg.agent, slot)
    resume = cfg.trainer.resume
    if resume is not None and resume not in RESUME_WORDS:
        found.append(
            InputPath("trainer.resume", resume, lambda p: setattr(cfg.trainer, "resume", p))
        )
    return found


def _setter(container, key) -> Callable[[str], None]:
    if isinstance(container, dict | list):
        return lambda value: container.__setitem__(key, value)
    return lambda value: setattr(container, key, value)


def _spec_path(key: str, spec: str, container, slot) -> list[InputPath]:
    """The file of a `file.py:name` spec, which is replaced in the spec; none for a module."""
    file = spec_file(spec)
    if file is None:
        return []
    name = spec[len(file) :]  # ":name"
    write = _setter(container, slot)
    return [InputPath(key, file, lambda p: write(p + name))]


def absolute_for_cluster(cfg: Config, here: Path) -> list[str]:
    """Make the config's relative input paths absolute against `here` (they exist there), in
    place; ConfigError naming the key for a relative output_dir or a relative path that is not
    here. Returns "key=absolute path" for each path made absolute."""
    output_dir = cfg.trainer.output_dir
    if not Path(output_dir).is_absolute():
        raise ConfigError(
            f"trainer.output_dir: {output_dir!r} is relative, and a submitted job runs in a "
            "temporary directory on the cluster that goes when the job ends; set an absolute "
            "path on storage the head and learner nodes share, e.g. "
            "--set trainer.output_dir=/shared/runs"
        )
    made = []
    for entry in input_paths(cfg):
        if Path(entry.path).is_absolute():
            continue
        local = here / entry.path
        if local.exists():
            absolute = os.path.normpath(local)
            entry.replace(absolute)
            made.append(f"{entry.key}={absolute}")
        elif not entry.may_be_a_hub_id or _plainly_a_path(entry.path):
            raise ConfigError(
                f"{entry.key}: {entry.path} is relative and not found in {here}; a submitted "
                "job runs in a temporary directory on the cluster, so give the absolute path "
                "where the cluster's nodes can read it"
            )
    return made


def _plainly_a_path(text: str) -> bool:
    return text.startswith((".", "~")) or text.endswith(FILE_SUFFIXES) or text.count("/") > 1
