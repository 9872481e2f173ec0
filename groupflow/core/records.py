"""The records that cross actor boundaries, defined once.

prompt -> SampledGroup (rollout) -> ScoredGroup (reward workers) -> TrainSequence
(driver, with advantages) -> learner. Weights do not travel as records: they go from the
learner ranks to the engines in buckets (groupflow/core/weight_format.py, actors/transport.py).
Plain dataclasses of lists, so they pickle cheaply through Ray's object store.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np


@dataclass
class Prompt:
    """One task instance: the text the model sees and what the verifier checks against."""

    uid: str
    text: str  # the raw (completion) prompt; "" for a dataset prompt given only as messages
    answer: Any
    # The chat wording ({"role", "content"} dicts) that a chat template renders; None = `text`
    # as one user turn.
    messages: list[dict] | None = None
    task: str | None = None  # its task's label in a job of several tasks (routes verification)
    max_tokens: int | None = None  # its task's response limit; None = rollout.sampling's


# How a tool call ended (rollout/toolbox.py), as the step's figures count them.
# "lost": the tool worker running it was lost and no other ran it in time: not the model's
# failure, and its trajectory is masked (groupflow/loop/infra_failures.py).
TOOL_OUTCOMES = ("ok", "error", "timeout", "malformed", "unknown", "lost")


@dataclass
class ToolUse:
    """One tool call in a trajectory: the tool the model named ("" where the call could not be
    read), how it ended (one of TOOL_OUTCOMES) and how long it took."""

    tool: str
    outcome: str
    seconds: float = 0.0


@dataclass
class Response:
    """One sampled response: a single completion, or a multi-turn trajectory (the model's turns
    and the observations inserted between them, rollout/trajectory.py)."""

    token_ids: list[int]
    text: str
    # vLLM's log-probs of the tokens the model sampled, one per model token (observations
    # have none)
    logprobs: list[float]
    finish_reason: str = "stop"  # "stop": EOS or a stop string; "length": cut at max_tokens
    # (policy version, index of its first token) for each run of tokens one version sampled,
    # in order: more than one where a weight sync landed while the response was generating
    # (rollout.partial_rollout). [] = all by its group's policy_version.
    versions: list[tuple[int, int]] = field(default_factory=list)
    # A trajectory's: per response token, 1 where the model sampled it, 0 for an observation
    # (TrainSequence.loss_mask); None for a single completion.
    loss_mask: list[int] | None = None
    turns: int = 1
    # Why a trajectory ended: "answer", "turn_limit", "token_limit", "deadline" or
    # "environment_error" (rollout/trajectory.py); None for a single completion.
    end_reason: str | None = None
    tool_uses: list[ToolUse] = field(default_factory=list)
    error: str | None = None  # what the environment raised, when end_reason says it did
    # Why the trajectory failed for a reason not the model's ("environment_error",
    # "environment_deadline", "tool_worker_lost"): it is masked, never scored or trained on
    # (groupflow/loop/infra_failures.py). None: the model's trajectory, whatever its end.
    infra_failure: str | None = None
    # A trajectory's last model turn, the one span its answer can occupy: what a verifier
    # reads (reward_workers/scorer.py). None for a single completion, whose text is all its own.
    final_turn: str | None = None
    # Runs of the trajectory's async users' code that held the engine's event loop
    # (rollout/loop_watch.py); 0 for a single completion.
    loop_blocks: int = 0
    # A mixture of experts' routing, from an engine that returns it: the experts each token of
    # prompt + response went through, (tokens, layers, top-k) small integers, for the first
    # tokens (the last token, which the engine never ran through the model, has none). None:
    # not returned (a dense model, or routing not asked for).
    routed_experts: np.ndarray | None = None
    # A harness trajectory's (agent.harness, rollout/harness_record.py): the ids its first call
    # was given, which are the harness's own rendering, not its group's prompt; None: the
    # group's `prompt_ids`.
    prompt_ids: list[int] | None = None
    # A harness trajectory's earlier sequences, split off where the harness rewrote its history:
    # each trained with this response's reward (loop/sequences.py).
    earlier: list[Response] = field(default_factory=list)

    @property
    def answer_text(self) -> str:
        """The text a verifier scores: the model's final turn, never an observation or a
        marker the model wrote in an earlier turn."""
        return self.text if self.final_turn is None else self.final_turn


@dataclass
class SampledGroup:
    """G responses to one prompt, from one vLLM request with n = G. `policy_version` is that
    of its oldest token: staleness counts from it."""

    prompt: Prompt
    prompt_ids: list[int]
    responses: list[Response]
    policy_version: int


@dataclass
class Verdict:
    """A verifier's score for one response: reward in [0, 1] and a human-readable reason."""

    reward: float
    reason: str
    error: str | None = None  # "error" or "timeout" when the verifier failed


@dataclass
class ScoredGroup:
    group: SampledGroup
    verdicts: list[Verdict]

    @property
    def rewards(self) -> list[float]:
        return [v.reward for v in self.verdicts]


@dataclass
class TrainSequence:
    """One response ready for the learner: prompt + response ids and its advantage."""

    input_ids: list[int]
    prompt_len: int
    advantage: float
    group_id: int  # index of its group within the step (cancellation diagnostics use it)
    policy_version: int
    # The behaviour policy's log-prob of each model token, as vLLM sampled it
    # (learner/off_policy.py); [] = unknown, the learner's own stand in for it.
    vllm_logprobs: list[float]
    # Per response token: 1 where the model sampled it, 0 for an observation inserted between
    # turns (a tool's result): in the forward as context, out of the loss and of every token
    # statistic (docs/algorithms.md, 'Observation tokens'). None: every one is the model's.
    loss_mask: list[int] | None = None
    # The engine's experts of the first tokens of input_ids (Response.routed_experts), which
    # routing replay uses and the routing disagreement compares with (learner/routing_replay.py)
    routed_experts: np.ndarray | None = None

    def __post_init__(self) -> None:
        where = f"sequence of group {self.group_id}"
        if self.loss_mask is not None:
            if len(self.loss_mask) != self.num_response_tokens:
                raise ValueError(
                    f"{where}: a loss mask of {len(self.loss_mask)} for "
                    f"{self.num_response_tokens} response tokens"
                )
            if any(m not in (0, 1) for m in self.loss_mask):
                raise ValueError(f"{where}: a loss mask holds 0 and 1 only")
        if self.routed_experts is not None and len(self.routed_experts) > len(self.input_ids):
            raise ValueError(
                f"{where}: routing of {len(self.routed_experts)} tokens for "
                f"{len(self.input_ids)} token ids"
            )
        if self.vllm_logprobs and len(self.vllm_logprobs) != self.num_model_tokens:
            raise ValueError(
                f"{where}: {len(self.vllm_logprobs)} vLLM log-probs for "
                f"{self.num_model_tokens} model tokens"
            )

    @property
    def num_response_tokens(self) -> int:
        return len(self.input_ids) - self.prompt_len

    @property
    def num_model_tokens(self) -> int:
        """Response tokens the model sampled (observations left out)."""
        if self.loss_mask is None:
            return self.num_response_tokens
        return sum(self.loss_mask)
