"""examples/: a config per common case, each one valid (load_config), with task options its
task takes, and a header that says what it is and how to run it."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from groupflow.reward_workers.tasks import task_class
from groupflow.reward_workers.tasks.mixture import mixture_entries
from groupflow.run.job_config import load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CASES = ["math_gsm8k_qwen_gpu", "mixture", "agent_tools", "lora", "multi_node"]


def test_every_common_case_has_an_example():
    assert sorted(p.stem for p in EXAMPLES.glob("*.yaml")) == sorted(CASES)


@pytest.mark.parametrize("name", CASES)
def test_an_example_is_a_valid_config_named_after_its_file(name):
    cfg = load_config(EXAMPLES / f"{name}.yaml")
    assert cfg.trainer.run_name == name
    assert cfg.model.path is not None, "an example is a real model's job"
    assert cfg.model.dtype == "bfloat16" and cfg.rollout.resources.num_gpus > 0


@pytest.mark.parametrize("name", CASES)
def test_an_examples_task_options_are_ones_its_task_takes(name):
    """load_config leaves a task's options to the task (it opens the datasets, which an example
    only names): each option must still be a parameter of the task's constructor."""
    task = load_config(EXAMPLES / f"{name}.yaml").task
    entries = [(task.name, task.options)]
    if task.name == "mixture":
        entries = [(e.name, e.options) for e in mixture_entries(task.options["tasks"])]
    for task_name, options in entries:
        inspect.signature(task_class(task_name)).bind(**options)  # TypeError on a stray option


@pytest.mark.parametrize("name", CASES)
def test_an_examples_header_says_what_it_is_and_how_to_run_it(name):
    text = (EXAMPLES / f"{name}.yaml").read_text()
    header = text[: text.index("\nmodel:")]
    assert all(line.startswith("#") for line in header.splitlines()), "a comment header"
    assert f"groupflow config examples/{name}.yaml" in header
    assert f"groupflow train examples/{name}.yaml" in header or (
        f"groupflow submit --address http://HEAD:8265 examples/{name}.yaml" in header
    )


def test_a_shared_path_example_writes_its_runs_to_an_absolute_directory():
    cfg = load_config(EXAMPLES / "multi_node.yaml")
    assert Path(cfg.trainer.output_dir).is_absolute()
    assert Path(cfg.model.path).is_absolute()
