"""A finite set of prompts (built-in or from a dataset file) served as a task's prompt source.

Training cycles through the train split in a fresh seeded order each epoch; evaluation takes
the first n held-out prompts. The split is either explicit (a built-in table, or a separate
eval file) or by a stable hash of the whole prompt (split_key): a prompt's side depends on
that prompt alone, so it stays put across runs and as rows are added, and copies of a prompt
(as text or as the same conversation) never land on both sides. A pool has at least one
prompt on each side, or it is refused.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

from groupflow.core.records import Prompt
from groupflow.reward_workers.datasets import load_prompts
from groupflow.reward_workers.tasks.base import hash_position, is_held_out
from groupflow.reward_workers.tasks.options import check_number

logger = logging.getLogger(__name__)

# Task options that only choose prompts; a verifier needs none of them.
POOL_OPTIONS = ("dataset", "eval_dataset", "fields", "skip_bad", "eval_fraction", "skip_prompts")
# The options among them that name files.
DATASET_OPTIONS = ("dataset", "eval_dataset")

# The datasets whose gold answers this process has warned about: the driver builds a job's
# task more than once, and the warning is worth one line.
_warned_datasets: set[tuple[str | None, ...]] = set()


class PromptPool:
    def __init__(
        self, task: str, train: list[Prompt], held_out: list[Prompt], source: str = "built-in"
    ):
        if not train:
            raise ValueError(f"{task}: no training prompts in {source}")
        if not held_out:
            raise ValueError(
                f"{task}: no held-out prompts to evaluate on in {source} (a dataset needs two "
                "different prompts, or an eval_dataset)"
            )
        self.task, self.train, self.held_out = task, train, held_out

    @classmethod
    def from_dataset(
        cls,
        task: str,
        dataset: str,
        *,
        eval_dataset: str | None,
        fields: Mapping[str, str] | str | None,
        skip_bad: bool,
        eval_fraction: float,
        parse_answer: Callable[[Any], Any],
        skip_prompts: Collection[str] = (),
    ) -> PromptPool:

        def load(path: str) -> list[Prompt]:
            loaded = load_prompts(path, fields, skip_bad=skip_bad, parse_answer=parse_answer)
            if loaded.skipped:
                logger.warning("%s: skipped %d malformed rows in %s", task, loaded.skipped, path)
            return [p for p in loaded.prompts if p.uid not in skip_prompts]

        prompts = load(dataset)
        if eval_dataset is not None:
            held_out = load(eval_dataset)
            held_keys = {split_key(p) for p in held_out}
            train = [p for p in prompts if split_key(p) not in held_keys]
            return cls(task, train, held_out, f"{dataset} and {eval_dataset}")
        return cls(task, *hash_split(prompts, eval_fraction), dataset)

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


def split_key(prompt: Prompt) -> str:
    """What the split hashes: the whole prompt. A text prompt and a lone user turn with the
    same text are the same prompt; the key of a text prompt is its text, as it always was."""
    turns = prompt.messages
    if turns is None:
        return prompt.text
    if len(turns) == 1 and turns[0]["role"] == "user":
        return turns[0]["content"]
    return json.dumps(turns, ensure_ascii=False, sort_keys=True)


def hash_split(prompts: list[Prompt], fraction: float) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held-out) by the hash of each prompt's split_key. When the hash leaves a side
    empty and there are two different prompts, the key nearest the cut moves across, so a
    small dataset still has something to train on and something to evaluate."""
    row_keys = [split_key(p) for p in prompts]
    keys = set(row_keys)
    held = {k for k in keys if is_held_out(k, fraction)}
    if len(keys) > 1 and not held:
        held = {min(keys, key=hash_position)}
    elif len(keys) > 1 and held == keys:
        held = keys - {max(keys, key=hash_position)}
    train = [p for p, key in zip(prompts, row_keys, strict=True) if key not in held]
    return train, [p for p, key in zip(prompts, row_keys, strict=True) if key in held]


class PooledTask:
    """A task whose prompts come from a fixed pool: its built-in problems, or a dataset file
    (JSONL/Parquet with a field mapping); either way each prompt gets the task's instruction."""

    name: str
    instruction: str

    def _builtin_split(self) -> tuple[list[Prompt], list[Prompt]]:
        raise NotImplementedError

    def parse_answer(self, raw: Any) -> Any:
        raise NotImplementedError

    def gold_answer_warning(self) -> str | None:
        """What makes the pool's gold answers unmatchable by the task's verifier, if any
        (e.g. worked solutions where a final answer belongs)."""
        return None

    def _load_pool(
        self,
        dataset: str | None,
        eval_dataset: str | None,
        fields: Mapping[str, str] | str | None,
        skip_bad: bool,
        eval_fraction: float,
        skip_prompts: Sequence[str] = (),
    ) -> None:
        if not isinstance(skip_prompts, list | tuple) or not all(
            isinstance(uid, str) for uid in skip_prompts
        ):
            raise ValueError(f"{self.name}: skip_prompts must be a list of prompt uids")
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
            skip_prompts=frozenset(skip_prompts),
        ).map(self._instructed)
        warning = self.gold_answer_warning()
        loaded = (self.name, dataset, eval_dataset, repr(fields))
        if warning and loaded not in _warned_datasets:
            _warned_datasets.add(loaded)
            files = dataset if eval_dataset is None else f"{dataset} and {eval_dataset}"
            logger.warning("%s: %s: %s", self.name, files, warning)

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
