"""The records that cross actor boundaries, defined once.

prompt -> SampledGroup (rollout) -> ScoredGroup (reward workers) -> TrainSequence
(driver, with advantages) -> learner. Weights go learner -> engines as (name, tensor) lists.
Plain dataclasses of lists, so they pickle cheaply through Ray's object store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Prompt:
    """One task instance: the text the model sees and what the verifier checks against."""

    uid: str
    text: str
    answer: Any


@dataclass
class Response:
    token_ids: list[int]
    text: str
    logprobs: list[float]  # vLLM's log-probs of the sampled tokens (kept for a mismatch metric)


@dataclass
class SampledGroup:
    """G responses to one prompt, from one vLLM request with n = G."""

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
    vllm_logprobs: list[float]

    @property
    def num_response_tokens(self) -> int:
        return len(self.input_ids) - self.prompt_len
