"""The job configuration: typed, validated pydantic models, one module per section, loaded from
YAML plus `--set` (load.py), and resolved against the wings' registries one floor up
(groupflow/run/job_config.py: build_config, load_config, resolve).

Every section forbids unknown keys, so a typo stops the job before anything starts, with a
one-line message naming the key (`ConfigError`). The section modules are the ground floor: they
import nothing of rollout/, learner/, reward_workers/ or actors/, so code on those floors imports
its models from them (`groupflow.config.algorithm`, ...); everything else imports from here.

    base.py        ConfigError, Section (the rule for numbers), Ray resources
    job.py         Config (every section; the checks across sections), the `model` section
    task.py        task, its held-out sets
    rollout.py     rollout, its sampling and autoscaling
    agent.py       agent (multi-turn tools)
    reward.py      reward, its overlong penalty
    learner.py     learner, its optimizer, ZeRO-3 knobs and LoRA
    algorithm.py   algorithm, its clip, KL, token-credit transforms and off-policy correction
    presets.py     the named algorithm presets
    trainer.py     trainer, metrics
    cluster.py     cluster
    bounded_yaml.py  YAML read within bounds
    load.py        validate_config (defaults, presets, --set, the schema), resolved_yaml
"""

from groupflow.config.agent import AgentConfig
from groupflow.config.algorithm import (
    EXCHANGEABLE_AGGREGATIONS,
    AlgorithmConfig,
    ARConfig,
    ClipConfig,
    DFPOConfig,
    EntropyMaskConfig,
    KLConfig,
    LoptiConfig,
    OffPolicyConfig,
    StapoConfig,
)
from groupflow.config.base import (
    ConfigError,
    EngineResources,
    LearnerRankResources,
    Resources,
    RewardWorkerResources,
    Section,
)
from groupflow.config.bounded_yaml import MAX_CONFIG_BYTES, parse_yaml
from groupflow.config.cluster import ClusterConfig, ray_client_refusal
from groupflow.config.job import Config, ModelConfig
from groupflow.config.learner import LearnerConfig, LoraConfig, OptimizerConfig, Zero3Config
from groupflow.config.load import (
    DERIVED,
    QUICKSTART,
    parse_override,
    resolved_yaml,
    validate_config,
)
from groupflow.config.presets import PRESETS
from groupflow.config.reward import OverlongPenaltyConfig, RewardConfig
from groupflow.config.rollout import AutoscaleConfig, RolloutConfig, SamplingConfig
from groupflow.config.task import EvalSetConfig, TaskConfig
from groupflow.config.trainer import MetricsConfig, TrainerConfig

__all__ = [
    "validate_config",
    "DERIVED",
    "EXCHANGEABLE_AGGREGATIONS",
    "MAX_CONFIG_BYTES",
    "PRESETS",
    "QUICKSTART",
    "ARConfig",
    "AgentConfig",
    "AlgorithmConfig",
    "AutoscaleConfig",
    "ClipConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "DFPOConfig",
    "EngineResources",
    "EntropyMaskConfig",
    "EvalSetConfig",
    "KLConfig",
    "LearnerConfig",
    "LearnerRankResources",
    "LoptiConfig",
    "LoraConfig",
    "MetricsConfig",
    "ModelConfig",
    "OffPolicyConfig",
    "OptimizerConfig",
    "OverlongPenaltyConfig",
    "Resources",
    "RewardConfig",
    "RewardWorkerResources",
    "RolloutConfig",
    "SamplingConfig",
    "Section",
    "StapoConfig",
    "TaskConfig",
    "TrainerConfig",
    "Zero3Config",
    "parse_override",
    "parse_yaml",
    "ray_client_refusal",
    "resolved_yaml",
]
