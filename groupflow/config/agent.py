"""The `agent` section: multi-turn trajectories with tools.

Tool names are checked against the built-in tools by `groupflow.config.load.resolve`, which
also writes the task's own tools here when `tools` is unset."""

from __future__ import annotations

from pydantic import Field, StrictInt, model_validator

from groupflow.config.base import FloatSetting, Section


class AgentConfig(Section):
    """Multi-turn trajectories with tools (docs/agents.md): on when the job has tools or an
    environment. Each model turn is one request; the environment's answer (tool results) is
    rendered once and appended, and trained as context only (docs/algorithms.md, 'Observation
    tokens')."""

    tools: list[str] | None = Field(
        None,
        description="tools the model may call: 'calculator', 'python' (sandboxed, in the tool "
        "pool) or 'module:name' of your own; unset = the task's own (tool_arithmetic: "
        "calculator; resolved configs list them here), [] = none",
    )
    environment: str | None = Field(
        None,
        description="'module:name' of a factory called with each trajectory's prompt, whose "
        "step(turn_text) returns the messages to insert or None to end; unset = run the tool "
        "calls (rollout/trajectory.py ToolEnvironment)",
    )
    harness: str | None = Field(
        None,
        description="'module:name' of an async function harness(row, endpoint) run per "
        "trajectory against its own OpenAI-compatible endpoint (endpoint.client, base_url, "
        "api_key), returning the text the verifier scores (docs/agents.md); exclusive with "
        "environment",
    )
    tool_parser: str = Field(
        "hermes",
        min_length=1,
        description="vLLM's tool parser that reads calls from a turn: 'hermes' for the "
        "Hermes/Qwen <tool_call> JSON format, or any other vLLM registers",
    )
    max_turns: StrictInt = Field(
        4, ge=1, le=64, description="model turns per trajectory (a harness's calls)"
    )
    max_total_tokens: StrictInt | None = Field(
        None,
        ge=2,
        description="a trajectory's token budget, observations included (DAPO's overlong "
        "penalty counts against it); unset = what the context leaves; each turn is limited by "
        "rollout.sampling.max_tokens",
    )
    deadline_s: FloatSetting = Field(
        300.0, gt=0, le=86_400, description="wall-clock limit of one trajectory"
    )
    tool_timeout_s: FloatSetting = Field(10.0, gt=0, le=3600, description="limit of one tool call")
    tool_output_chars: StrictInt = Field(
        2000, ge=16, le=1_000_000, description="a tool result is cut to this many characters"
    )
    tool_workers: StrictInt = Field(
        1, ge=1, le=4096, description="tool-pool actors that run the python tool's sandboxes"
    )
    allow_weak_sandbox: bool = Field(
        False,
        description="run the python tool where the sandbox lacks its kernel layers "
        "(docs/sandbox.md); refused otherwise",
    )

    @property
    def trajectory_setting(self) -> str:
        """The setting whose code a trajectory that ended `environment_error` failed in."""
        return "agent.harness" if self.harness is not None else "agent.environment"

    @model_validator(mode="after")
    def _one_driver(self) -> AgentConfig:
        if self.harness is not None and self.environment is not None:
            raise ValueError(
                "agent.harness: a harness drives its own trajectories; unset agent.environment"
            )
        return self
