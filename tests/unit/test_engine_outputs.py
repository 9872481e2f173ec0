"""What an engine makes of vLLM's outputs (rollout/engine.py): each response's runs of tokens by
the policy version that sampled them, from vLLM's weight-version labels."""

from __future__ import annotations

import random
from dataclasses import dataclass

from groupflow.rollout.engine import _response


@dataclass
class Span:  # vLLM's WeightVersionSpan
    version: str
    start: int
    end: int


@dataclass
class Completion:  # the fields of vLLM's CompletionOutput an engine reads
    token_ids: list[int]
    text: str
    logprobs: list[dict] | None
    finish_reason: str
    weight_versions: list[Span] | None
    routed_experts: object = (
        None  # set where the engine returns routing (rollout/routing_capture.py)
    )


class Logprob:
    def __init__(self, logprob: float):
        self.logprob = logprob


def completion(spans: list[Span] | None, n: int) -> Completion:
    ids = [random.randrange(100) for _ in range(n)]
    return Completion(ids, "x" * n, [{t: Logprob(-0.5)} for t in ids], "length", spans)


def test_runs_of_tokens_carry_the_version_that_sampled_them():
    rng = random.Random()
    for _ in range(50):
        n = rng.randint(2, 300)
        cuts = sorted(rng.sample(range(1, n), rng.randint(0, min(4, n - 1))))
        bounds = [0, *cuts, n]
        first = rng.randint(0, 5)
        labels = ["default" if first == 0 else str(first)] + [
            str(first + i) for i in range(1, len(bounds) - 1)
        ]
        spans = [Span(v, s, e) for v, s, e in zip(labels, bounds, bounds[1:], strict=False)]
        response = _response(completion(spans, n), submitted_at=first)
        assert response.versions == [(first + i, s) for i, s in enumerate(bounds[:-1])]
        assert len(response.token_ids) == len(response.logprobs) == n


def test_a_response_without_labels_is_the_submission_version():
    assert _response(completion(None, 5), submitted_at=3).versions == [(3, 0)]
    # vLLM's label before an engine's first sync names no version: the submission's
    assert _response(completion([Span("default", 0, 4)], 4), submitted_at=0).versions == [(0, 0)]
