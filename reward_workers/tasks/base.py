"""What a task is: a source of prompts with ground truth, and a verifier for responses."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from typing import Any, Protocol

from groupflow.core.records import Prompt, Verdict


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


def hash_position(key: str) -> float:
    """A key's stable place in [0, 1), the same in every run and process."""
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def is_held_out(key: str, fraction: float = 0.1) -> bool:
    """Stable split: a problem belongs to the held-out set by a hash of its text."""
    return hash_position(key) < fraction


class GeneratedTask:
    """Prompts drawn from a seeded generator (`_make`), split into train and held-out sets
    by a hash of each problem, so the two never meet whatever the seed."""

    def _make(self, rng: random.Random) -> Prompt:
        raise NotImplementedError

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        rng = random.Random(seed)
        while True:
            prompt = self._make(rng)
            if not is_held_out(prompt.uid):
                yield prompt

    def eval_prompts(self, n: int) -> list[Prompt]:
        rng = random.Random(-1)
        seen: dict[str, Prompt] = {}
        for _ in range(1000 * n):
            prompt = self._make(rng)
            if is_held_out(prompt.uid):
                seen.setdefault(prompt.uid, prompt)
                if len(seen) == n:
                    break
        return list(seen.values())
