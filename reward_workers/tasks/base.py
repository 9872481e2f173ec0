"""What a task is: a source of prompts with ground truth, and a verifier for responses."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any, Protocol

from groupflow.records import Prompt, Verdict


class Task(Protocol):
    name: str

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        """An endless stream of training prompts, reproducible from the seed."""

    def eval_prompts(self, n: int) -> list[Prompt]:
        """A fixed held-out set, disjoint from what train_prompts yields."""

    def verify(self, prompt: Prompt, response: str) -> Verdict:
        """Score one response in [0, 1] with a reason."""

    def parse_answer(self, raw: Any) -> Any:
        """Validate and convert a ground-truth answer read from a file (JSON); ValueError
        with a short reason when it is malformed."""


def is_held_out(key: str, fraction: float = 0.1) -> bool:
    """Stable split: a problem belongs to the held-out set by a hash of its text."""
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction
