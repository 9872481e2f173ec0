"""What a run reads and checks before it holds its name, writes anything or touches Ray: the
model (`model.path`, a hub id read from the local cache, or the built-in one, built), LoRA's
target modules, the trackers, and the prompts the model can take (groupflow/run/job_prompts.py).
`groupflow train` checks them first (groupflow/run/driver.py); `train --dry-run` and
`config --check` stop there (groupflow/run/dry_run.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from groupflow.config import Config
from groupflow.core.errors import RunError
from groupflow.core.hub_model import local_model_path
from groupflow.core.model_dir import (
    check_context,
    check_tensor_parallel,
    model_context,
    read_model_config,
)
from groupflow.learner.lora import check_target_modules
from groupflow.learner.moe_aux import check_aux_loss
from groupflow.learner.routing_replay import check_replay_model
from groupflow.learner.sequence_parallel import check_heads
from groupflow.observe.trackers import check_trackers
from groupflow.run.job_config import check_resolved
from groupflow.run.job_prompts import VettedPrompts, vet_prompts
from groupflow.run.quickstart import ARCHITECTURE, quickstart_model_path


def resolve_model_path(cfg: Config) -> str:
    """The model directory the job trains (or `groupflow eval` scores), its context checked
    against `rollout.max_model_len`; the built-in model is built here when `model.path` is
    unset."""
    if cfg.model.path is None:
        # A config file's defaults fit a real model: say so before the built-in one is built.
        check_context(
            cfg.rollout.max_model_len,
            ARCHITECTURE["max_position_embeddings"],
            "the built-in model (model.path unset; `groupflow config --quickstart` shows the "
            "sizes that fit it)",
        )
        return str(
            quickstart_model_path(
                cfg.task.name, cfg.task.options, cfg.model.warm_start_steps, cfg.metrics.progress
            )
        )
    path = Path(local_model_path(cfg.model.path))
    if not (path / "config.json").is_file():
        raise RunError(f"model.path: {path} is not a Hugging Face model directory (no config.json)")
    check_context(cfg.rollout.max_model_len, model_context(read_model_config(path)), str(path))
    return str(path)


@dataclass
class CheckedInputs:
    model_path: str
    prompts: VettedPrompts


def check_inputs(cfg: Config) -> CheckedInputs:
    """The model, LoRA's target modules, the load-balancing loss's model, the trackers, the
    tokenizer and chat template on every prompt, the datasets and the task options; the first
    failure raises its one-line error."""
    check_resolved(cfg)
    model_path = resolve_model_path(cfg)
    check_tensor_parallel(
        cfg.rollout.tensor_parallel_size, read_model_config(model_path), model_path
    )
    if cfg.learner.lora is not None:
        check_target_modules(model_path, cfg.learner.lora)
    check_aux_loss(model_path, cfg.learner.moe)
    if cfg.learner.moe.routing_replay != "off":
        check_replay_model(model_path, cfg.learner.moe.routing_replay)
    check_sequence_parallel(cfg, model_path)
    check_trackers(cfg)
    return CheckedInputs(model_path, vet_prompts(cfg, model_path))


def check_sequence_parallel(cfg: Config, model_path: str) -> None:
    """learner.sequence_parallel_size divides the model's attention heads (ConfigError)."""
    if cfg.learner.sequence_parallel_size > 1:
        model_config = read_model_config(model_path)
        text = model_config.get("text_config", model_config)
        heads = int(text["num_attention_heads"])
        check_heads(heads, cfg.learner.sequence_parallel_size, str(model_path))
