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
from dataclasses import dataclass, replace
from itertools import islice
from typing import TYPE_CHECKING, Any

from groupflow.records import Prompt
from groupflow.reward_workers.datasets import load_prompts
from groupflow.reward_workers.tasks.base import Task, hash_position, is_held_out
from groupflow.reward_workers.tasks.options import check_number
from groupflow.rollout.prompt_render import too_long, too_long_message

if TYPE_CHECKING:
    from groupflow.config.job import Config

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


# Prompts too long for the engines are left out of a dataset when they are at most this share
# of it (a few odd rows); more means the limit does not suit the data, and the job is refused.
MAX_TOO_LONG_SHARE = 0.01


@dataclass
class PromptSource:
    """The prompts that one task of a job hands out, and the options it is built from: the
    job config's own dict, so that prompts left out there are left out in every process."""

    name: str  # how messages name it: "task", "task math", "task.eval_sets hard"
    options: dict[str, Any]
    task: Task
    prompts: list[Prompt]


def job_prompt_sources(cfg: Config) -> list[PromptSource]:
    """The job's task (each of a mixture's tasks), then each of `task.eval_sets`."""
    task = cfg.task
    if task.name == "mixture":
        sources = [
            prompt_source(
                f"task {e.get('label', e['name'])}",
                e["name"],
                e.setdefault("options", {}),
                task.eval_size,
                e.get("max_tokens"),
            )
            for e in task.options["tasks"]
        ]
    else:
        sources = [prompt_source("task", task.name, task.options, task.eval_size)]
    for held_out in task.eval_sets:
        name = f"task.eval_sets {held_out.name}"
        sources.append(prompt_source(name, held_out.task, held_out.options, held_out.size, None))
    return sources


def prompt_source(
    name: str, task_name: str, options: dict, eval_size: int, max_tokens: int | None = None
) -> PromptSource:
    """Every prompt the task can hand out when its prompts are a finite pool, else the first
    `eval_size` of each of its streams; with a mixture entry's `max_tokens`."""
    from groupflow.reward_workers.tasks import make_task

    task = make_task(task_name, options)
    if isinstance(task, PooledTask):
        prompts = task.pool.train + task.pool.held_out
    else:
        prompts = task.eval_prompts(eval_size) + list(islice(task.train_prompts(0), eval_size))
    if max_tokens is not None:
        prompts = [replace(p, max_tokens=max_tokens) for p in prompts]
    return PromptSource(name, options, task, prompts)


def fit_to_engines(
    sources: Sequence[PromptSource], lengths: Sequence[int], max_model_len: int, max_tokens: int
) -> dict[str, int]:
    """Given every source's prompts' token counts in order: leave out the prompts too long for
    the engines where they are a few rows of a dataset, else ValueError naming the first.
    How many each source left out, by its name (0 included)."""
    measured = iter(lengths)
    left_out = {}
    for source in sources:
        counts = [next(measured) for _ in source.prompts]
        overlong = too_long(source.prompts, counts, max_model_len, max_tokens)
        if overlong:
            message = too_long_message(overlong, len(source.prompts), max_model_len, max_tokens)
            leave_out(source, [p for p, _ in overlong], f"{source.name}: {message}")
        left_out[source.name] = len(overlong)
    return left_out


def leave_out(source: PromptSource, overlong: list[Prompt], error: str) -> None:
    """Leave the prompts out of a dataset (skip_prompts in its options) when they are at most
    MAX_TOO_LONG_SHARE of it and both sides of its split keep a prompt, else ValueError."""
    files = [source.options[k] for k in DATASET_OPTIONS if source.options.get(k)]
    if not files or len(overlong) > MAX_TOO_LONG_SHARE * len(source.prompts):
        raise ValueError(f"{error}: shorten or drop them, or raise rollout.max_model_len")
    uids = {p.uid for p in overlong}
    pool = source.task.pool
    PromptPool(
        source.name,
        [p for p in pool.train if p.uid not in uids],
        [p for p in pool.held_out if p.uid not in uids],
        f"{' and '.join(files)} once the prompts too long for the engines are left out",
    )
    source.options["skip_prompts"] = sorted(uids | set(source.options.get("skip_prompts", ())))
    logger.warning("%s: left out of training and evaluation", error)
