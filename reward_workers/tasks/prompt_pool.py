"""A finite set of prompts (built-in or from a dataset file) served as a task's prompt source.

Training cycles through the train split in a fresh seeded order each epoch; evaluation takes
the first n held-out prompts. The split is either explicit (a built-in table, or a separate
eval file) or by a stable hash of the prompt text (is_held_out).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from groupflow.records import Prompt
from groupflow.reward_workers.datasets import load_prompts
from groupflow.reward_workers.tasks.base import is_held_out
from groupflow.reward_workers.tasks.options import check_number

logger = logging.getLogger(__name__)

# Task options that only choose prompts; a verifier needs none of them.
POOL_OPTIONS = ("dataset", "eval_dataset", "fields", "skip_bad", "eval_fraction")


class PromptPool:
    def __init__(self, task: str, train: list[Prompt], held_out: list[Prompt]):
        if not train:
            raise ValueError(f"{task}: no training prompts")
        self.task, self.train, self.held_out = task, train, held_out

    @classmethod
    def from_dataset(
        cls,
        task: str,
        dataset: str,
        *,
        eval_dataset: str | None,
        fields: Mapping[str, str] | None,
        skip_bad: bool,
        eval_fraction: float,
        parse_answer: Callable[[Any], Any],
    ) -> PromptPool:

        def load(path: str) -> list[Prompt]:
            loaded = load_prompts(path, fields, skip_bad=skip_bad, parse_answer=parse_answer)
            if loaded.skipped:
                logger.warning("%s: skipped %d malformed rows in %s", task, loaded.skipped, path)
            return loaded.prompts

        prompts = load(dataset)
        if eval_dataset is not None:
            held_out = load(eval_dataset)
            held_texts = {p.text for p in held_out}
            return cls(task, [p for p in prompts if p.text not in held_texts], held_out)
        train = [p for p in prompts if not is_held_out(p.text, eval_fraction)]
        held_out = [p for p in prompts if is_held_out(p.text, eval_fraction)]
        return cls(task, train, held_out)

    def map(self, fn: Callable[[Prompt], Prompt]) -> PromptPool:
        """The same pool with every prompt rewritten (e.g. an instruction appended)."""
        return PromptPool(self.task, [fn(p) for p in self.train], [fn(p) for p in self.held_out])

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        rng = random.Random(seed)
        order = list(self.train)
        while True:
            rng.shuffle(order)
            yield from order

    def eval_prompts(self, n: int) -> list[Prompt]:
        """Up to n held-out prompts (fewer when the set is smaller)."""
        return self.held_out[:n]


class PooledTask:
    """A task whose prompts come from a fixed pool: its built-in problems, or a dataset file
    (JSONL/Parquet with a field mapping); either way each prompt gets the task's instruction."""

    name: str
    instruction: str

    def _builtin_split(self) -> tuple[list[Prompt], list[Prompt]]:
        raise NotImplementedError

    def parse_answer(self, raw: Any) -> Any:
        raise NotImplementedError

    def _load_pool(
        self,
        dataset: str | None,
        eval_dataset: str | None,
        fields: Mapping[str, str] | None,
        skip_bad: bool,
        eval_fraction: float,
    ) -> None:
        if (
            not check_number(self.name, "eval_fraction", eval_fraction, 0.0, 1.0)
            or eval_fraction == 1
        ):
            raise ValueError(
                f"{self.name}: eval_fraction must be in (0, 1) (got {eval_fraction!r})"
            )
        if dataset is None:
            self.pool = PromptPool(self.name, *self._builtin_split())
            return
        self.pool = PromptPool.from_dataset(
            self.name,
            dataset,
            eval_dataset=eval_dataset,
            fields=fields,
            skip_bad=skip_bad,
            eval_fraction=eval_fraction,
            parse_answer=self.parse_answer,
        ).map(self._instructed)

    def _instructed(self, prompt: Prompt) -> Prompt:
        """The prompt with the task's answer-format instruction after its (last user) text."""
        if not self.instruction:
            return prompt
        if prompt.messages is None:
            text = f"{prompt.text}\n{self.instruction}"
            return Prompt(uid=prompt.uid, text=text, answer=prompt.answer)
        turns = [dict(t) for t in prompt.messages]
        last_user = max(i for i, t in enumerate(turns) if t["role"] == "user")
        turns[last_user]["content"] += f"\n{self.instruction}"
        return Prompt(uid=prompt.uid, text="", answer=prompt.answer, messages=turns)

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        return self.pool.train_prompts(seed)

    def eval_prompts(self, n: int) -> list[Prompt]:
        return self.pool.eval_prompts(n)
