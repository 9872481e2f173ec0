"""Which prompts this model can take: the one home of a job's prompt checks, for `groupflow
train`, `train --dry-run`, `config --check` and `groupflow eval` alike.

Every prompt the job can draw (its task's, each of a mixture's tasks', each `task.eval_sets`
set's) is rendered through the model's tokenizer and the job's chat template in a vetting child
(rollout/prompt_render.py: a template that fails, stalls or runs away is refused in one line),
and measured; the prompts too long for the engines are left out of their datasets, or the job
is refused. This joins the two wings that know half of it each, the renderer (rollout/) and the
tasks' prompt pools (reward_workers/), so it lives above both, and starts nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache
from itertools import islice
from typing import Any

from groupflow.config import Config
from groupflow.core.records import Prompt
from groupflow.reward_workers.tasks import make_task
from groupflow.reward_workers.tasks.base import Task
from groupflow.reward_workers.tasks.prompt_pool import DATASET_OPTIONS, PooledTask, PromptPool
from groupflow.rollout.agent import Agent
from groupflow.rollout.engine import engine_settings
from groupflow.rollout.prompt_render import PromptRenderer, too_long, too_long_message

logger = logging.getLogger(__name__)

# Prompts too long for the engines are left out of a dataset when they are at most this share
# of it (a few odd rows); more means the limit does not suit the data, and the job is refused.
MAX_TOO_LONG_SHARE = 0.01


@cache  # read once: the vetting and the run's sample log share it
def job_tokenizer(model_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@dataclass
class PromptSource:
    """The prompts that one task of a job hands out, and the options it is built from: the
    job config's own dict, so that prompts left out there are left out in every process."""

    name: str  # how messages name it: "task", "task math", "task.eval_sets hard"
    options: dict[str, Any]
    task: Task
    prompts: list[Prompt]


@dataclass
class VettedPrompts:
    """Every prompt the job can draw, rendered and measured (vet_prompts)."""

    renderer: PromptRenderer
    sources: list[PromptSource]
    left_out: dict[str, int]  # too long for the engines, by prompt source


def vet_prompts(cfg: Config, model_path: str) -> VettedPrompts:
    """Before any actor starts: the chat settings against the model's tokenizer, the chat
    template vetted on every prompt the job can draw, and the prompts too long for the engines
    left out of their datasets (in `cfg`'s task options, so every process leaves them out),
    or the job refused. In a multi-turn job also the tools, their parser, and the template's
    rendering of tool messages (rollout/agent.py)."""
    settings = engine_settings(cfg, model_path, 0)
    agent = None if settings.agent is None else Agent(settings.agent, run_code=None)
    chat = settings.chat if agent is None else agent.chat(settings.chat)
    renderer = PromptRenderer(job_tokenizer(model_path), chat)
    if agent is not None:
        agent.start(renderer)
    sources = job_prompt_sources(cfg)
    lengths = renderer.vetted_lengths([p for source in sources for p in source.prompts])
    rollout = cfg.rollout
    left_out = fit_to_engines(sources, lengths, rollout.max_model_len, rollout.sampling.max_tokens)
    return VettedPrompts(renderer, sources, left_out)


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
