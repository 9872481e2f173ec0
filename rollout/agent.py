"""What an engine of a multi-turn job holds beside vLLM (`agent` settings, docs/agents.md): the
tools, the parser of their calls, the renderer of observations and the environment of each
trajectory, and how one trajectory is run (rollout/trajectory.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from groupflow.core.records import Prompt, Response
from groupflow.core.user_code import UserCodeError, load_user_object
from groupflow.rollout.observations import ObservationRenderer
from groupflow.rollout.prompt_render import ChatSettings, PromptRenderer
from groupflow.rollout.python_tool import RunCode
from groupflow.rollout.toolbox import ToolBox, ToolCallParser
from groupflow.rollout.tools import BUILTIN_TOOLS, make_tools
from groupflow.rollout.trajectory import (
    EnvironmentFactory,
    Generate,
    ToolEnvironment,
    TurnLimits,
    run_trajectory,
)


@dataclass(frozen=True)
class AgentSettings:
    tools: list[str]
    environment: str | None
    tool_parser: str
    max_turns: int
    max_total_tokens: int | None  # None: what the context leaves
    deadline_s: float
    tool_timeout_s: float
    tool_output_chars: int
    harness: str | None = None  # 'module:name' (rollout/harness.py)

    @classmethod
    def of(cls, cfg) -> AgentSettings:
        """The agent part of a job config (groupflow.config.Config)."""
        agent = cfg.agent
        return cls(
            tools=cfg.agent_tools(),
            environment=agent.environment,
            tool_parser=agent.tool_parser,
            max_turns=agent.max_turns,
            max_total_tokens=agent.max_total_tokens,
            deadline_s=agent.deadline_s,
            tool_timeout_s=agent.tool_timeout_s,
            tool_output_chars=agent.tool_output_chars,
            harness=agent.harness,
        )


class Agent:
    def __init__(self, settings: AgentSettings, run_code: RunCode | None):
        self.settings = settings
        tools = make_tools(settings.tools, run_code, settings.tool_timeout_s)
        builtin = frozenset(n for n in settings.tools if n in BUILTIN_TOOLS)
        self.tools = ToolBox(tools, settings.tool_timeout_s, settings.tool_output_chars, builtin)
        self.environment: EnvironmentFactory = self._tool_environment
        if settings.environment is not None:
            self.environment = user_environment(settings.environment, self.tools)
        self.harness = None if settings.harness is None else user_harness(settings.harness)
        self.parser: ToolCallParser | None = None
        self.observations: ObservationRenderer | None = None

    def chat(self, chat: ChatSettings) -> ChatSettings:
        """The job's chat settings with the tools declared to the template."""
        return replace(chat, tools=self.tools.schemas or None)

    def start(self, renderer: PromptRenderer) -> None:
        """Parser and observation renderer for this tokenizer; PromptRenderError or
        ValueError (one line) where the template or the parser cannot serve."""
        self.parser = ToolCallParser(
            self.settings.tool_parser, renderer.tokenizer, self.tools.schemas
        )
        self.observations = ObservationRenderer(renderer)

    async def _tool_environment(self, prompt: Prompt) -> ToolEnvironment:
        # async: made on the loop, never in a thread that users' hung code may hold
        return ToolEnvironment(prompt, self.tools, self.parser)

    async def trajectory(
        self,
        prompt: Prompt,
        prompt_ids: list[int],
        generate: Generate,
        turn_tokens: int,
        max_model_len: int,
    ) -> Response:
        settings = self.settings
        limits = TurnLimits(
            max_turns=settings.max_turns,
            turn_tokens=turn_tokens,
            total_tokens=settings.max_total_tokens or max_model_len,
            deadline_s=settings.deadline_s,
        )
        return await run_trajectory(
            prompt,
            prompt_ids,
            generate,
            self.environment,
            self.observations,
            limits,
            max_model_len,
        )


def user_environment(spec: str, tools: ToolBox) -> EnvironmentFactory:
    """`agent.environment`: a factory called as factory(prompt, tools) for each trajectory."""
    factory = load_user_object(spec, "agent.environment")
    if not callable(factory):
        raise UserCodeError(f"agent.environment {spec!r}: is not callable")
    return lambda prompt: factory(prompt, tools)


def user_harness(spec: str):
    """`agent.harness`: called as harness(row, endpoint) for each trajectory."""
    harness = load_user_object(spec, "agent.harness")
    if not callable(harness):
        raise UserCodeError(f"agent.harness {spec!r}: is not callable")
    return harness
