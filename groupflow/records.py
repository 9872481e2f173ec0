"""The records that cross actor boundaries, defined once.

prompt -> SampledGroup (rollout) -> ScoredGroup (reward workers) -> TrainSequence
(driver, with advantages) -> learner; WeightBundle goes learner -> engines.
Plain dataclasses of lists and tensors, so they pickle cheaply through Ray's object store.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


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
    finish_reason: str


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
    reward: float
    group_id: int  # index of its group within the step (cancellation diagnostics use it)
    policy_version: int
    vllm_logprobs: list[float]

    @property
    def num_response_tokens(self) -> int:
        return len(self.input_ids) - self.prompt_len


@dataclass
class WeightBundle:
    """Full (gathered) parameters of one policy version, in Hugging Face names."""

    version: int
    named_tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
