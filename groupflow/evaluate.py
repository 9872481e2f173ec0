"""Held-out greedy accuracy of a model on a task: the number `summary.json` reports, for any
model directory (`groupflow eval`)."""

from __future__ import annotations

from groupflow.config import Config
from groupflow.records import Prompt
from groupflow.reward_workers.tasks.base import Task


def greedy_accuracy(task: Task, prompts: list[Prompt], texts: list[str]) -> float:
    """Share of prompts whose greedy answer gets the full reward."""
    rewards = [task.verify(p, text).reward for p, text in zip(prompts, texts, strict=True)]
    return sum(r >= 1.0 for r in rewards) / len(rewards)


def evaluate_model(cfg: Config, model_path: str) -> dict:
    """One in-process vLLM engine, greedy decoding on the task's held-out prompts."""
    from groupflow.reward_workers.tasks import make_task
    from groupflow.rollout.engine import RolloutEngine, engine_settings

    task = make_task(cfg.task.name, cfg.task.options)
    prompts = task.eval_prompts(cfg.task.eval_size)
    engine = RolloutEngine(engine_settings(cfg, model_path, seed=cfg.trainer.seed))
    texts = engine.greedy(prompts, cfg.rollout.sampling.max_tokens)
    return {
        "model": model_path,
        "task": cfg.task.name,
        "prompts": len(prompts),
        "accuracy": greedy_accuracy(task, prompts, texts),
    }
