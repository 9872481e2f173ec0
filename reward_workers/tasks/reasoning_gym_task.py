"""`task.name: reasoning_gym:<dataset>`: one of reasoning-gym's procedural datasets as a task,
its generator giving the rows and its own `score_answer` the reward (docs/environments.md).

The dataset's config fields (reasoning-gym's `<Dataset>Config` dataclass, less `seed` and
`size`, which the stream sets) are the task's options, checked like a built-in task's; the
task adds `answer_format`. Rows come in seeds of `ROWS_PER_SEED`: reasoning-gym makes row i of
seed s from `Random(s + i)`, so consecutive seeds would repeat each other's rows shifted by
one, and each seed of the stream is instead drawn from a stream-seeded generator.

Training and held-out rows are split by a hash of the question (`is_held_out`), as the
built-in generated tasks split theirs: whatever the seeds, a held-out question is never
trained on. The held-out set comes from a seed of its own.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import logging
import math
import random
import typing
from collections.abc import Iterator
from typing import Any, Literal

from groupflow.core.records import Prompt, Verdict
from groupflow.reward_workers.tasks.base import is_held_out

logger = logging.getLogger(__name__)

PACKAGE = "reasoning_gym"
ROWS_PER_SEED = 500  # reasoning-gym's own default dataset size
HELD_OUT_SEED = 2**31 - 1
# The held-out search draws at most this many rows per held-out prompt asked for: a tenth of
# the rows is held out, so a space with enough problems gives them well within it.
HELD_OUT_DRAWS = 50
# The fields of a dataset's config that the stream sets, not the user.
STREAM_FIELDS = ("seed", "size")
# How a response is read: reasoning-gym's convention of the answer in <answer> tags, or the
# whole response (a small model that was never taught tags, e.g. the built-in quickstart model).
ANSWER_FORMATS = ("tags", "plain")
TAGS_INSTRUCTION = "Give your final answer in <answer> </answer> tags."
LIST_DATASETS = 'python -c "import reasoning_gym.factory as f; print(*sorted(f.DATASETS))"'


def _registry() -> dict[str, tuple[type, type]]:
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ValueError(
            "task.name: reasoning_gym:... needs the reasoning-gym package "
            "(pip install 'groupflow[envs]')"
        ) from None
    return DATASETS


def _dataset_classes(dataset: str) -> tuple[type, type]:
    """(dataset class, config class) of a reasoning-gym dataset, or a one-line ValueError
    naming the task and how to list the valid names."""
    datasets = _registry()
    if dataset not in datasets:
        close = difflib.get_close_matches(dataset, datasets, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ValueError(
            f"task.name: unknown reasoning-gym dataset {dataset!r}; {hint}"
            f"the {len(datasets)} datasets are listed by: {LIST_DATASETS}"
        )
    return datasets[dataset]


@functools.cache
def declared_options(dataset: str) -> dict[str, inspect.Parameter]:
    """The task's options: the dataset config's fields, with their types and defaults, less
    the stream's own, and `answer_format`."""
    _, config_cls = _dataset_classes(dataset)
    hints = typing.get_type_hints(config_cls)
    options = {}
    for field in dataclasses.fields(config_cls):
        if field.name in STREAM_FIELDS:
            continue
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            default = inspect.Parameter.empty
        options[field.name] = inspect.Parameter(
            field.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=default,
            annotation=_as_written(hints.get(field.name, inspect.Parameter.empty)),
        )
    options["answer_format"] = inspect.Parameter(
        "answer_format",
        inspect.Parameter.KEYWORD_ONLY,
        default="tags",
        annotation=Literal["tags", "plain"],
    )
    return options


def _as_written(annotation: Any) -> Any:
    """A config field's type as a YAML config can write it: a float field takes an integer
    too (`0.5` or `1`), and a tuple field a list, as reasoning-gym itself accepts them. A type
    pydantic cannot check is left to the dataset's own checks."""
    from pydantic import TypeAdapter

    if annotation is float:
        return float | int
    if typing.get_origin(annotation) is tuple:
        return list
    try:
        TypeAdapter(annotation)
    except Exception:
        return inspect.Parameter.empty
    return annotation


class ReasoningGymTask:
    """Rows of reasoning-gym dataset `dataset`; the reward is the dataset's own score."""

    def __init__(self, dataset: str, **options: Any):
        self.dataset_cls, self.config_cls = _dataset_classes(dataset)
        self.name = f"{PACKAGE}:{dataset}"
        self.dataset = dataset
        self.answer_format = options.pop("answer_format", "tags")
        if self.answer_format not in ANSWER_FORMATS:
            raise ValueError(
                f"task.options.answer_format: one of {', '.join(ANSWER_FORMATS)} "
                f"(got {self.answer_format!r})"
            )
        self.options = options
        # Built once here, so that a config the dataset refuses is one line at the start,
        # and the scorer of every row: reasoning-gym scores with the dataset's config.
        self.scorer = self._rows(HELD_OUT_SEED, 1)

    def _rows(self, seed: int, size: int):
        try:
            config = self.config_cls(**self.options, seed=seed, size=size)
            return self.dataset_cls(config=config)
        except Exception as err:  # the dataset's own checks are asserts and TypeErrors
            raise ValueError(f"task.options: {self.name} refused its config: {err}") from None

    def _seeded_rows(self, seed: int) -> Iterator[dict]:
        """Endless rows: seeds drawn from `seed`, ROWS_PER_SEED rows of each."""
        seeds = random.Random(seed)
        while True:
            yield from self._rows(seeds.randrange(2**31 - 1), ROWS_PER_SEED)

    def _prompt(self, row: dict) -> Prompt:
        question = row["question"]
        text = f"{question}\n{TAGS_INSTRUCTION}" if self.answer_format == "tags" else question
        answer = {"question": question, "answer": row["answer"], "metadata": row["metadata"]}
        return Prompt(uid=question, text=text, answer=answer)

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        for row in self._seeded_rows(seed):
            if not is_held_out(row["question"]):
                yield self._prompt(row)

    def eval_prompts(self, n: int) -> list[Prompt]:
        """The first n distinct held-out questions of the held-out seed (fewer, with a
        warning, where the dataset has fewer within HELD_OUT_DRAWS * n rows)."""
        seen: dict[str, Prompt] = {}
        rows = self._seeded_rows(HELD_OUT_SEED)
        for _ in range(HELD_OUT_DRAWS * n):
            row = next(rows)
            if is_held_out(row["question"]):
                seen.setdefault(row["question"], self._prompt(row))
                if len(seen) == n:
                    break
        if len(seen) < n:
            logger.warning(
                "%s: %d held-out prompts asked for, found %d distinct held-out questions in "
                "%d rows: evaluating on those",
                self.name,
                n,
                len(seen),
                HELD_OUT_DRAWS * n,
            )
        return list(seen.values())

    def demonstration(self, prompt: Prompt) -> str:
        """The answer as the task reads it, for the built-in model's warm start."""
        answer = str(prompt.answer["answer"])
        return f"<answer>{answer}</answer>" if self.answer_format == "tags" else answer

    def extract(self, response: str) -> str | None:
        if self.answer_format == "plain":
            return response.strip()
        from reasoning_gym.utils import extract_answer

        return extract_answer(response)

    def verify(self, prompt: Prompt, response: str) -> Verdict:
        """reasoning-gym's score of the extracted answer, as the reward: its partial scores
        (a number in (0, 1) that some datasets give a near miss) stay partial."""
        answer = self.extract(response)
        if answer is None:
            return Verdict(0.0, "no <answer> </answer> tags in the response")
        score = self.scorer.score_answer(answer, prompt.answer)
        if (
            isinstance(score, bool)
            or not isinstance(score, int | float)
            or not math.isfinite(score)
        ):
            return Verdict(0.0, f"{self.name} scored {score!r}, not a number", error="error")
        reward = min(1.0, max(0.0, float(score)))
        gold = prompt.answer["answer"]
        if reward >= 1.0:
            return Verdict(1.0, f"correct: {answer[:80]!r}")
        return Verdict(reward, f"scored {reward:g}: {answer[:80]!r}, gold {str(gold)[:80]!r}")

    def parse_answer(self, raw: Any) -> Any:
        raise ValueError(f"{self.name} reads no answers from files: its generator makes them")
