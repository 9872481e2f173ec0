"""The DeepSpeed config of a learner rank, built from the `learner` section of the job config.

ZeRO-3's parameter knobs are tuned by model size and world size (docs/zero3_tuning.md): the
default settings gather every parameter of every module before its forward and backward,
hooks whose host time dominates a step of a 0.5B-7B model, and at world size 1 partitioning
saves no memory at all.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache

from groupflow.config.learner import LearnerConfig, Zero3Config

# Parameters up to this count are kept whole on every rank: at most 4 GB of bf16 weights.
WHOLE_MODEL_PARAMETERS = 2_000_000_000
# Up to this count (3B-16B), only matrices are partitioned and gathers run in larger buckets.
MID_MODEL_PARAMETERS = 16_000_000_000


@dataclass(frozen=True)
class Zero3Tuning:
    """ZeRO-3's parameter knobs, in elements (DeepSpeed's stage3_* settings)."""

    param_persistence_threshold: int
    prefetch_bucket_size: int
    max_live_parameters: int
    overlap_comm: bool


def zero3_tuning(num_parameters: int, world_size: int, offload_params: bool) -> Zero3Tuning:
    """The table of docs/zero3_tuning.md: the knobs for a model of `num_parameters` trained on
    `world_size` ranks."""
    whole = Zero3Tuning(num_parameters, 0, num_parameters, overlap_comm=world_size > 1)
    if offload_params:  # the shards live in host memory: keep ZeRO-3's defaults
        return Zero3Tuning(100_000, 50_000_000, 1_000_000_000, overlap_comm=True)
    if world_size == 1 or num_parameters <= WHOLE_MODEL_PARAMETERS:
        return whole
    if num_parameters <= MID_MODEL_PARAMETERS:
        return Zero3Tuning(1_000_000, 200_000_000, 2_000_000_000, overlap_comm=True)
    return Zero3Tuning(100_000, 50_000_000, 1_000_000_000, overlap_comm=True)


def tuned(cfg: Zero3Config, num_parameters: int, world_size: int, offload_params: bool):
    """The table's knobs with the config's settings over them."""
    table = zero3_tuning(num_parameters, world_size, offload_params)
    return replace(table, **{k: v for k, v in cfg.model_dump().items() if v is not None})


def deepspeed_config(cfg: LearnerConfig, dtype: str, num_parameters: int, world_size: int) -> dict:
    """The ZeRO-3 config dict for `deepspeed.initialize` (and HfDeepSpeedConfig) with the
    model in `dtype` ("float32", "bfloat16" or "float16"), of `num_parameters` parameters
    (model_parameter_count), trained on `world_size` ranks."""
    knobs = tuned(cfg.zero3, num_parameters, world_size, cfg.offload_params)
    zero: dict = {
        "stage": cfg.zero_stage,
        "stage3_param_persistence_threshold": knobs.param_persistence_threshold,
        "stage3_prefetch_bucket_size": knobs.prefetch_bucket_size,
        "stage3_max_live_parameters": knobs.max_live_parameters,
        "overlap_comm": knobs.overlap_comm,
    }
    if cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if cfg.offload_params:
        zero["offload_param"] = {"device": "cpu"}
    return {
        # The rank accumulates micro-batches itself and marks the boundary, one "sample" each.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.optimizer.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == "bfloat16"},
        "fp16": {"enabled": dtype == "float16"},
        "zero_allow_untested_optimizer": True,
        # The optimizer is the learner's torch AdamW; with offload it steps on the CPU copies
        # (DeepSpeed would otherwise insist on its compiled CPU Adam).
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,
    }


@cache  # a rank asks twice as it starts: its checkpointing choice, then ZeRO-3's knobs
def model_parameter_count(path: str) -> int:
    """Parameters of the Hugging Face causal LM at `path` (a tied head counted once), from
    its config alone: the model is built on the meta device, no weights are read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return sum(p.numel() for p in model.parameters())
