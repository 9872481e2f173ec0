"""The job configuration: typed, validated pydantic models, loaded from YAML plus `--set`.

Every section forbids unknown keys, so a typo stops the job before anything starts,
with a one-line message naming the key (`ConfigError`).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from learner.presets import PRESETS


class ConfigError(ValueError):
    """A config problem, phrased as one line that names the offending key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Resources(Section):
    """Ray resources for one actor. CPU machines use fractional CPUs; GPU clusters set num_gpus."""

    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    torch_threads: int = Field(1, ge=1, description="intra-op threads for torch in the actor")
    custom: dict[str, float] = Field(
        default_factory=dict,
        description="custom Ray resources, e.g. {groupflow_rollout: 1} to pin a worker group",
    )


class ModelConfig(Section):
    path: str | None = Field(
        None,
        description="local Hugging Face model directory; unset = the built-in quickstart model",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    warm_start_steps: int = Field(
        300, ge=0, description="supervised warm-start steps for the built-in model (cached)"
    )


class TaskConfig(Section):
    name: str = Field("arithmetic", description="a built-in task (see reward_workers.tasks)")
    options: dict[str, Any] = Field(default_factory=dict, description="task-specific settings")
    eval_size: int = Field(256, ge=1, description="held-out prompts for greedy accuracy")
    seed: int = 1234


class SamplingConfig(Section):
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(16, ge=1)


class RolloutConfig(Section):
    num_engines: int = Field(1, ge=1)
    group_size: int = Field(8, ge=1, description="G: responses sampled per prompt")
    prompts_per_step: int = Field(32, ge=1)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    resources: Resources = Field(default_factory=lambda: Resources(num_cpus=0.5))
    kv_cache_gib: float = Field(
        1.0, gt=0, description="KV cache size on CPU (VLLM_CPU_KVCACHE_SPACE)"
    )
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    max_model_len: int = Field(256, ge=8)
    weight_transport: Literal["object_store", "collective"] = Field(
        "object_store",
        description="how new weights reach the engines: Ray's object store, or a broadcast "
        "from learner rank 0 (NCCL on GPUs, gloo on CPUs)",
    )


class RewardConfig(Section):
    num_workers: int = Field(2, ge=1)
    verifier: str | None = Field(
        None, description="unset = the task's own verifier; or a plugin 'module:function' / file.py"
    )
    timeout_s: float = Field(30.0, gt=0, description="per-batch scoring timeout")
    max_retries: int = Field(2, ge=0)
    resources: Resources = Field(default_factory=lambda: Resources(num_cpus=0.25))


class OptimizerConfig(Section):
    name: Literal["adamw"] = "adamw"
    lr: float = Field(1e-5, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)


class LearnerConfig(Section):
    num_ranks: int = Field(2, ge=1)
    zero_stage: Literal[3] = 3
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    micro_batch_tokens: int = Field(4096, ge=1, description="token budget of one micro-batch")
    mini_batches_per_step: int = Field(1, ge=1, description="optimizer updates per step")
    resources: Resources = Field(default_factory=lambda: Resources(num_cpus=0.5))


class ClipConfig(Section):
    eps_low: float = Field(0.2, ge=0)
    eps_high: float = Field(0.28, ge=0)
    dual_clip: float | None = Field(None, gt=1, description="c of dual clip (e.g. 3); unset = off")


class KLConfig(Section):
    coef: float = Field(0.0, ge=0)
    estimator: Literal["k1", "k2", "k3"] = "k3"


class StapoConfig(Section):
    enabled: bool = False
    tau_p: float = Field(0.002, gt=0, le=1)
    quantile: float = Field(0.75, ge=0, le=1)
    prob_source: Literal["current", "old"] = "current"


class ARConfig(Section):
    alpha: float = Field(0.0, ge=0, le=1, description="0 = off (plain advantages)")


class LoptiConfig(Section):
    enabled: bool = False
    eta: float = Field(
        0.5, ge=-1, le=1, description="probability threshold; < 0 reverses the order"
    )


class EntropyMaskConfig(Section):
    enabled: bool = False
    rho: float = Field(0.2, gt=0, le=1)


class DFPOConfig(Section):
    weight_transform: Literal["min_replace", "adv_orthogonal"] = "min_replace"


EXCHANGEABLE_AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "constant")


class AlgorithmConfig(Section):
    preset: str = Field("grpo", description="named method; its keys are defaults for this section")
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_baseline"] = "grpo"
    std: Literal["unbiased", "biased", "none"] = "unbiased"
    loss: Literal["ppo", "gspo", "linear", "dfpo"] = "ppo"
    aggregation: Literal["token_mean", "seq_mean_token_sum", "constant", "seq_mean_token_mean"] = (
        "token_mean"
    )
    clip: ClipConfig = Field(default_factory=ClipConfig)
    kl: KLConfig = Field(default_factory=KLConfig)
    entropy_coef: float = 0.0
    dynamic_sampling: bool = Field(False, description="drop zero-variance groups and draw more")
    stapo: StapoConfig = Field(default_factory=StapoConfig)
    ar: ARConfig = Field(default_factory=ARConfig)
    lopti: LoptiConfig = Field(default_factory=LoptiConfig)
    entropy_mask: EntropyMaskConfig = Field(default_factory=EntropyMaskConfig)
    dfpo: DFPOConfig = Field(default_factory=DFPOConfig)
    lowprob_eta: float = Field(
        0.5, gt=0, le=1, description="p threshold of the low-prob diagnostics"
    )
    cancellation_diagnostic: bool = Field(
        True, description="collect dLoss/dlogp per token for cancellation_residual"
    )

    @model_validator(mode="after")
    def _check(self) -> AlgorithmConfig:
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {sorted(PRESETS)}")
        if self.loss == "dfpo" and self.aggregation not in EXCHANGEABLE_AGGREGATIONS:
            raise ValueError(
                f"loss 'dfpo' relies on token gradient cancellation, which aggregation "
                f"{self.aggregation!r} breaks; use one of {list(EXCHANGEABLE_AGGREGATIONS)}"
            )
        return self


class TrainerConfig(Section):
    steps: int = Field(20, ge=1)
    seed: int = 0
    output_dir: str = "runs"
    run_name: str = "quickstart"
    max_staleness: int = Field(
        0, ge=0, le=1, description="0 = on-policy; 1 = overlap gen and learn"
    )
    eval_every: int = Field(
        0, ge=0, description="greedy eval every N steps; 0 = start and end only"
    )


class MetricsConfig(Section):
    prometheus_port: int | None = Field(None, ge=0, le=65535, description="unset = no endpoint")
    prometheus_addr: str = Field("0.0.0.0", description="interface to serve metrics on")
    progress: bool = Field(True, description="progress bar on a terminal")


class ClusterConfig(Section):
    address: str | None = Field(None, description="Ray address; unset = a local cluster")
    num_cpus: float | None = Field(
        None, gt=0, description="CPUs of a local cluster; unset = detected"
    )


class Config(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)

    @model_validator(mode="after")
    def _check(self) -> Config:
        if self.learner.mini_batches_per_step > self.rollout.prompts_per_step:
            raise ValueError(
                "learner.mini_batches_per_step: "
                f"{self.learner.mini_batches_per_step} mini-batches cannot be cut from "
                f"rollout.prompts_per_step={self.rollout.prompts_per_step} groups"
            )
        if self.rollout.sampling.max_tokens >= self.rollout.max_model_len:
            raise ValueError(
                f"rollout.sampling.max_tokens ({self.rollout.sampling.max_tokens}) must be below "
                f"rollout.max_model_len ({self.rollout.max_model_len})"
            )
        return self

    def dump_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


# YAML 1.1 reads these as booleans; on a command line they are far more often names
# (`--set trainer.run_name=off`). true/false still give booleans.
_YAML11_BOOL_WORDS = {"on", "off", "yes", "no", "y", "n"}


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (['a','b','c'], parsed value); the value is read as YAML."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r}: expected key.path=value")
    value = value.strip()
    if value.lower() in _YAML11_BOOL_WORDS:
        return key.strip().split("."), value
    try:
        parsed = yaml.safe_load(value) if value else None
    except yaml.YAMLError:
        raise ConfigError(f"--set {text!r}: the value is not valid YAML") from None
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
        msg += f" (got {first['input']!r})"
    return f"{key}: {msg}"


def build_config(raw: dict | None = None, overrides: list[str] = ()) -> Config:
    """Validate a raw dict plus `--set` overrides; the algorithm preset fills in defaults."""
    tree = copy.deepcopy(raw or {})
    for text in overrides:
        path, value = parse_override(text)
        _set_path(tree, path, value)
    algorithm = tree.get("algorithm", {})
    if isinstance(algorithm, dict):
        preset = algorithm.get("preset", AlgorithmConfig.model_fields["preset"].default)
        if isinstance(preset, str) and preset in PRESETS:
            tree["algorithm"] = _merge(PRESETS[preset], algorithm)
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


QUICKSTART = Path(__file__).with_name("quickstart.yaml")


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Load a YAML config (None = the built-in quickstart job) and apply overrides."""
    path = Path(path) if path is not None else QUICKSTART
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return build_config(raw, overrides)
