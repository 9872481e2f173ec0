"""A multi-turn trajectory, token in and token out: the model's turn, then the environment's
observation (tool results), then the next turn, until the environment ends it or a limit does.

Each turn is one engine request on the trajectory's ids so far, so a group's trajectories go
at their own pace and a slow tool holds one trajectory, not a batch. A trajectory's ids are
the prompt's, then every turn's exactly as the engine generated them, then every observation
rendered once (rollout/observations.py): nothing is re-tokenised or re-rendered, and the loss
mask marks the observation tokens, which the learner reads but never trains
(docs/algorithms.md, 'Observation tokens'). No Ray and no vLLM in here: the engine hands in
its request (`Generate`).

An environment (`agent.environment`, or the built-in `ToolEnvironment` that runs the calls of
`agent.tools`) is made per trajectory and told each model turn; it answers with the messages
to insert, or None to end the trajectory. One that raises, whatever it raises, or answers
with something that is not an answer ends its trajectory with `end_reason`
"environment_error" (reward 0, counted), never the job. Such a trajectory, one whose tool
worker was lost, and one whose deadline passed while its environment held it, failed for a
reason that is not the model's: `Response.infra_failure` says which, and the job masks it
(groupflow/loop/infra_failures.py).

The engine's event loop runs every trajectory of the engine, its stepping and its weight loads,
so no size an environment chooses reaches it unbounded: an observation whose text cannot fit
the trajectory's room (more characters than the room's tokens can hold,
`ObservationRenderer.max_chars`) ends it "token_limit" before it is rendered, and one that may
fit is rendered and tokenised in a thread (`ObservationRenderer.ids_off_loop`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from groupflow.core.records import Prompt, Response, ToolUse
from groupflow.core.user_code import raised_text
from groupflow.rollout.environment_reply import (
    InvalidObservation,
    Observation,
    checked_observation,
)
from groupflow.rollout.loop_watch import TRAJECTORY_BLOCKS, BlockCount
from groupflow.rollout.observations import ObservationRenderer
from groupflow.rollout.toolbox import ToolBox, ToolCallParser
from groupflow.rollout.user_calls import USER_CALLS, UserCodeFailed, user_attribute


@dataclass(frozen=True)
class TurnLimits:
    max_turns: int
    turn_tokens: int  # one turn's response limit
    total_tokens: int  # the whole trajectory's, observations included
    deadline_s: float  # wall-clock, from the first turn's submission


class Environment(Protocol):
    def step(self, turn: str) -> Observation | list[dict] | None | Awaitable: ...


# What the engine gives a trajectory: sample one turn of at most `max_tokens` tokens after
# `ids`, as the `turn`-th turn (which seeds it), returned as a one-response Response.
Generate = Callable[[list[int], int, int], Awaitable[Response]]


class ToolEnvironment:
    """The built-in environment: the model's tool calls are run and their results inserted as
    tool messages; a turn without a call is the answer. A call that cannot be read, or names
    no declared tool, becomes an error message the model reads."""

    def __init__(self, prompt: Prompt, tools: ToolBox, parser: ToolCallParser):
        self.tools = tools
        self.parser = parser

    async def step(self, turn: str) -> Observation | None:
        parsed = self.parser.parse(turn)
        if parsed.malformed is not None:
            return Observation(
                [{"role": "tool", "content": f"error: {parsed.malformed}"}],
                [ToolUse("", "malformed")],
            )
        if not parsed.calls:
            return None
        replies = await asyncio.gather(*(self.tools.call(c) for c in parsed.calls))
        return Observation(
            [{"role": "tool", "content": r.content} for r in replies], [r.use for r in replies]
        )


EnvironmentFactory = Callable[[Prompt], Environment]


async def run_trajectory(
    prompt: Prompt,
    prompt_ids: list[int],
    generate: Generate,
    environment: EnvironmentFactory,
    observations: ObservationRenderer,
    limits: TurnLimits,
    max_model_len: int,
    clock: Callable[[], float] = time.monotonic,
) -> Response:
    """One trajectory from `prompt` to its end (its `end_reason`, groupflow/core/records.py), as
    one Response whose `loss_mask` marks the model's tokens."""
    trajectory = _Trajectory()
    counting = TRAJECTORY_BLOCKS.set(trajectory.loop_blocks)  # its users' code's loop blocks
    try:
        return await _run(
            prompt,
            prompt_ids,
            generate,
            environment,
            observations,
            limits,
            max_model_len,
            clock,
            trajectory,
        )
    finally:
        TRAJECTORY_BLOCKS.reset(counting)


async def _run(
    prompt: Prompt,
    prompt_ids: list[int],
    generate: Generate,
    environment: EnvironmentFactory,
    observations: ObservationRenderer,
    limits: TurnLimits,
    max_model_len: int,
    clock: Callable[[], float],
    trajectory: _Trajectory,
) -> Response:
    deadline = clock() + limits.deadline_s
    step = None  # the environment's, made after the first turn: every trajectory holds one
    for turn in range(limits.max_turns):
        room = min(
            limits.turn_tokens,
            limits.total_tokens - trajectory.length,
            max_model_len - len(prompt_ids) - trajectory.length,
        )
        if room <= 0:
            return trajectory.end("token_limit")
        sampled = await generate(prompt_ids + trajectory.ids, room, turn)
        trajectory.add_turn(sampled)
        if sampled.finish_reason == "length":
            return trajectory.end("token_limit", finish_reason="length")
        left = deadline - clock()
        if left <= 0:
            return trajectory.end("deadline")
        try:
            if step is None:
                made = USER_CALLS.call(environment, prompt, culprit="agent.environment")
                env = await asyncio.wait_for(made, left)
                step = user_attribute(env, "step")
            reply = await asyncio.wait_for(_step(step, sampled.text), deadline - clock())
        except TimeoutError:  # the deadline's: one the environment raised is UserCodeFailed
            return trajectory.end("deadline", infra_failure="environment_deadline")
        except (UserCodeFailed, InvalidObservation) as err:
            return trajectory.end("environment_error", error=str(err))
        if reply is None:
            return trajectory.end("answer")
        trajectory.tool_uses += reply.tool_uses
        if any(use.outcome == "lost" for use in reply.tool_uses):
            lost = "a tool worker was lost under the call"
            return trajectory.end("environment_error", error=lost, infra_failure="tool_worker_lost")
        if turn + 1 == limits.max_turns:
            return trajectory.end("turn_limit")
        room = min(limits.total_tokens, max_model_len - len(prompt_ids)) - trajectory.length
        if _chars(reply.messages) > observations.max_chars(room):
            return trajectory.end("token_limit")  # cannot fit: not worth rendering
        try:
            last = sampled.token_ids[-1] if sampled.token_ids else None
            ids, text = await observations.ids_off_loop(reply.messages, last)
        except Exception as err:  # messages the template cannot render: the environment's
            return trajectory.end("environment_error", error=raised_text(err))
        if len(ids) >= room:
            return trajectory.end("token_limit")
        trajectory.add_observation(ids, text)
    return trajectory.end("turn_limit")


async def _step(step: Callable, turn: str) -> Observation | None:
    return checked_observation(await USER_CALLS.call(step, turn, culprit="agent.environment"))


def _chars(messages: list[dict]) -> int:
    """The characters of the messages' texts (role, content and any other text field)."""
    return sum(len(v) for m in messages for v in m.values() if isinstance(v, str))


class _Trajectory:
    def __init__(self):
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[tuple[int, int]] = []
        # the engine's routing of prompt + trajectory so far, each token's from the first
        # request that ran it: a turn's request routes the earlier turns' last token and the
        # observations as its prompt, and its own tokens as it samples them
        self.routing: list[np.ndarray] = []
        self.routed = 0
        self.texts: list[str] = []
        self.turns = 0
        self.final_turn = ""
        self.tool_uses: list[ToolUse] = []
        self.loop_blocks = BlockCount()

    @property
    def length(self) -> int:
        return len(self.ids)

    def add_turn(self, sampled: Response) -> None:
        for version, start in sampled.versions:
            if not self.versions or self.versions[-1][0] != version:
                self.versions.append((version, self.length + start))
        if sampled.routed_experts is not None:
            self.routing.append(sampled.routed_experts[self.routed :])
            self.routed = max(self.routed, len(sampled.routed_experts))
        self.ids += sampled.token_ids
        self.mask += [1] * len(sampled.token_ids)
        self.logprobs += sampled.logprobs
        self.texts.append(sampled.text)
        self.final_turn = sampled.text
        self.turns += 1

    def add_observation(self, ids: list[int], text: str) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)
        self.texts.append(text)

    def end(
        self,
        reason: str,
        finish_reason: str = "stop",
        error: str | None = None,
        infra_failure: str | None = None,
    ) -> Response:
        if reason == "environment_error" and infra_failure is None:
            infra_failure = "environment_error"
        return Response(
            token_ids=self.ids,
            text="".join(self.texts),
            logprobs=self.logprobs,
            finish_reason=finish_reason,
            versions=self.versions,
            loss_mask=self.mask,
            turns=self.turns,
            end_reason=reason,
            tool_uses=self.tool_uses,
            error=error,
            infra_failure=infra_failure,
            final_turn=self.final_turn,
            loop_blocks=self.loop_blocks.n,
            routed_experts=np.concatenate(self.routing) if self.routing else None,
        )
