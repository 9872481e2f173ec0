"""What a task is: a source of prompts with ground truth, and a verifier for responses."""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from groupflow.core.records import Prompt, Verdict

logger = logging.getLogger(__name__)

# The (task, size) pairs this process has said are larger than the task's held-out set.
_warned_sizes: set[tuple[str, int]] = set()


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


def copyable(answer: Any) -> bool:
    """An answer the built-in model's warm start can copy: text or a number. A record
    (countdown's numbers and target, code's tests) has nothing to copy: warm-started on its
    repr, the model would learn to write a dict."""
    return not isinstance(answer, bool) and isinstance(answer, str | int | float)


def demonstration_turns(task: Any, prompt: Prompt) -> list[tuple[str, bool]]:
    """What the built-in model's warm start (groupflow/run/quickstart.py) trains on after
    `prompt`: (text, trained) pieces, "" for the end-of-text token. A multi-turn task's own
    turns (tool results untrained), else the task's worked answer, else the bare answer;
    ValueError (one line) for a task whose answers are not text to copy."""
    if hasattr(task, "demonstration_turns"):
        return task.demonstration_turns(prompt)
    if hasattr(task, "demonstration"):
        return [(task.demonstration(prompt), True), ("", True)]
    answer = prompt.answer
    if not copyable(answer):
        raise ValueError(
            f"task.name: {task.name}: the built-in model (model.path unset) is warm-started "
            f"by copying each prompt's answer, and this task's answers are not text "
            f"({type(answer).__name__}); set model.path to a model of your own"
        )
    return [(str(answer), True), ("", True)]


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

    name: str

    def _make(self, rng: random.Random) -> Prompt:
        raise NotImplementedError

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        rng = random.Random(seed)
        while True:
            prompt = self._make(rng)
            if not is_held_out(prompt.uid):
                yield prompt

    def _problem_uids(self, at_most: int) -> Iterable[str] | None:
        """The uid of every problem the generator can make, when there are at most `at_most`
        of them; None when there are more (or the generator cannot list them)."""
        return None

    def eval_prompts(self, n: int) -> list[Prompt]:
        """The first n distinct held-out problems the generator draws from seed -1. A problem
        space with fewer than n held-out problems gives them all (and says so), found without
        drawing the 1000 * n candidates the search is bounded by."""
        wanted = n
        # A tenth of a space is held out, so only one under 20 * n holds fewer than n (past
        # that, a freak of the hash is still ended by the bounded search).
        uids = self._problem_uids(20 * n)
        if uids is not None:
            held_out = sum(1 for uid in uids if is_held_out(uid))
            if held_out < n and (self.name, n) not in _warned_sizes:
                _warned_sizes.add((self.name, n))  # the driver builds a job's task more than once
                logger.warning(
                    "%s: %d held-out prompts asked for, but the task has only %d distinct "
                    "held-out problems: evaluating on those %d",
                    self.name,
                    n,
                    held_out,
                    held_out,
                )
            wanted = min(n, held_out)
        rng = random.Random(-1)
        seen: dict[str, Prompt] = {}
        for _ in range(1000 * n):
            if len(seen) == wanted:
                break
            prompt = self._make(rng)
            if is_held_out(prompt.uid):
                seen.setdefault(prompt.uid, prompt)
        return list(seen.values())
