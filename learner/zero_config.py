"""The DeepSpeed config of a learner rank, built from the `learner` section of the job config."""

from __future__ import annotations

from groupflow.config import LearnerConfig


def deepspeed_config(cfg: LearnerConfig, dtype: str) -> dict:
    """The ZeRO-3 config dict for `deepspeed.initialize` (and HfDeepSpeedConfig) with the
    model in `dtype` ("float32", "bfloat16" or "float16")."""
    zero: dict = {"stage": cfg.zero_stage}
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
