"""The whole job: the `model` section and `Config`, which holds every section and checks the
settings that span sections (each section checks its own)."""

from __future__ import annotations

from typing import Literal

import yaml
from pydantic import Field, StrictInt, model_validator

from groupflow.config.agent import AgentConfig
from groupflow.config.algorithm import AlgorithmConfig
from groupflow.config.base import Section
from groupflow.config.cluster import ClusterConfig
from groupflow.config.learner import LearnerConfig
from groupflow.config.reward import RewardConfig
from groupflow.config.rollout import RolloutConfig
from groupflow.config.task import TaskConfig
from groupflow.config.trainer import MetricsConfig, TrainerConfig


class ModelConfig(Section):
    """The policy model: a local Hugging Face model directory, or the built-in one."""

    path: str | None = Field(
        None,
        description="local Hugging Face model directory, or a Hugging Face model id "
        "(org/name[@revision], from the hub cache, downloaded when not there; docs/hub.md); "
        "unset = the built-in quickstart model",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="the weights' dtype in the engines and the learner (one dtype, so every "
        "weight sync is bit-exact): bfloat16 for a real model on GPUs (the learner keeps fp32 "
        "master weights); float32 on CPU",
    )
    warm_start_steps: StrictInt = Field(
        300, ge=0, description="supervised warm-start steps for the built-in model (cached)"
    )


class Config(Section):
    """A groupflow job."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)

    def agent_tools(self) -> list[str]:
        """The job's tools. `resolve` wrote the task's own into agent.tools where it was unset
        and the task has some, so unset here means none."""
        return list(self.agent.tools or ())

    @property
    def multi_turn(self) -> bool:
        agent = self.agent
        return (
            bool(self.agent_tools()) or agent.environment is not None or agent.harness is not None
        )

    @model_validator(mode="after")
    def _check(self) -> Config:
        if self.learner.mini_batches_per_step > self.rollout.prompts_per_step:
            raise ValueError(
                "learner.mini_batches_per_step: "
                f"{self.learner.mini_batches_per_step} mini-batches cannot be cut from "
                f"rollout.prompts_per_step={self.rollout.prompts_per_step} groups"
            )
        # A mixture's own per-task limits are checked the same way by `resolve`, which reads
        # the task list.
        check_response_limit(self, "rollout.sampling.max_tokens", self.rollout.sampling.max_tokens)
        return self

    def dump_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def check_response_limit(cfg: Config, where: str, limit: int) -> None:
    """A response limit (`where`, e.g. rollout.sampling.max_tokens) leaves room for a prompt
    in the engine's context and exceeds the overlong penalty's buffer; ValueError otherwise."""
    if limit >= cfg.rollout.max_model_len:
        raise ValueError(
            f"{where} ({limit}) must be below rollout.max_model_len ({cfg.rollout.max_model_len})"
        )
    penalty = cfg.reward.overlong_penalty
    if penalty is not None and penalty.buffer_tokens >= limit:
        raise ValueError(
            f"reward.overlong_penalty.buffer_tokens ({penalty.buffer_tokens}) must be "
            f"below {where} ({limit})"
        )
