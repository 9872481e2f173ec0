"""Held-out scores of a model on a task: greedy accuracy (the number `summary.json` reports),
and mean@n and pass@k of n sampled answers; for a training job or any model directory
(`groupflow eval`)."""

from __future__ import annotations

import asyncio

from groupflow.adapters import engine_max_rank, is_adapter_dir, read_adapter_dir
from groupflow.config import Config, EvalSetConfig, check_resolved
from groupflow.model_dir import read_model_config
from groupflow.progress import PhaseProgress, heartbeat
from groupflow.records import Prompt


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The unbiased estimate of pass@k from n samples of which `correct` passed (Chen et al.
    2021, arXiv 2107.03374): 1 - C(n-c, k) / C(n, k), as a product that cannot overflow."""
    if not 0 < k <= n or not 0 <= correct <= n:
        raise ValueError(f"pass@{k} needs 0 < k <= n and 0 <= correct <= n (n={n}, c={correct})")
    if n - correct < k:
        return 1.0
    miss = 1.0
    for i in range(n - correct + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def sampled_scores(rewards: list[list[float]], k: int) -> tuple[float, float]:
    """(mean@n, pass@k) of n sampled answers per prompt: the mean reward over every sample,
    and pass@k averaged over prompts; a sample passes with the full reward."""
    n = len(rewards[0])
    mean = sum(map(sum, rewards)) / (n * len(rewards))
    passed = [pass_at_k(n, sum(r >= 1.0 for r in row), k) for row in rewards]
    return mean, sum(passed) / len(passed)


def greedy_share(rewards: list[list[float]]) -> float:
    """Share of prompts whose (one, greedy) answer gets the full reward."""
    return sum(row[0] >= 1.0 for row in rewards) / len(rewards)


def greedy_share_by_task(prompts: list[Prompt], rewards: list[list[float]]) -> dict[str, float]:
    """greedy_share of each task's prompts in a job of several tasks (a mixture labels each
    prompt with its task); empty for a job of one task."""
    by_task: dict[str, list[list[float]]] = {}
    for prompt, row in zip(prompts, rewards, strict=True):
        if prompt.task is not None:
            by_task.setdefault(prompt.task, []).append(row)
    return {task: greedy_share(rows) for task, rows in by_task.items()}


def evaluate_model(cfg: Config, model_path: str) -> dict:
    """One in-process vLLM engine on the task's held-out prompts; the answers are scored as
    the reward workers score them, in scorer processes killed at their deadline. `model_path`
    is a model directory or a LoRA adapter saved in PEFT's format (served on its base)."""
    from groupflow.driver import check_prompt_rendering
    from groupflow.reward_workers.scorer import Scorer
    from groupflow.reward_workers.tasks import make_task
    from groupflow.rollout.engine import EngineLora, RolloutEngine, engine_settings
    from groupflow.rollout.tools import in_process_run_code

    check_resolved(cfg)
    adapter = read_adapter_dir(model_path) if is_adapter_dir(model_path) else None
    base = model_path if adapter is None else adapter.base
    read_model_config(base)
    check_prompt_rendering(cfg, base)  # the template vetted, prompts too long left out
    prompts = make_task(cfg.task.name, cfg.task.options).eval_prompts(cfg.task.eval_size)
    settings = engine_settings(cfg, base, seed=cfg.trainer.seed)
    if adapter is not None:
        tensors = adapter.tensors()  # checked against the base before an engine starts
        settings.lora = EngineLora(engine_max_rank(adapter.config["r"]), adapter.config)
    # no tool pool here: the python tool's sandboxes start from this process
    python = "python" in cfg.agent_tools()
    run_code = in_process_run_code(cfg.agent.allow_weak_sandbox) if python else None
    # the engine's start and the answers block: a heartbeat says where a long evaluation is
    with heartbeat(PhaseProgress("evaluation")) as progress:
        progress.update(note="starting the engine")
        engine = RolloutEngine(settings, run_code)
        if adapter is not None:
            engine.load_weights(tensors, version=0)
        reward = cfg.reward
        scorer = Scorer(
            cfg.task.name,
            cfg.task.options,
            plugin=reward.verifier,
            timeout_s=reward.plugin_timeout_s,
            processes=reward.scorer_processes,
        )
        loop = asyncio.new_event_loop()  # the engine's requests are coroutines
        n = cfg.trainer.eval_samples

        def rewards(greedy: bool) -> list[list[float]]:
            answers = "greedy answers" if greedy else f"{n} sampled answers"
            progress.update(note=f"{answers} to {len(prompts)} prompts")
            groups = loop.run_until_complete(
                engine.complete(prompts, n, cfg.rollout.sampling, greedy)
            )
            return [sg.rewards for sg in scorer.score_groups(groups)]

        try:
            greedy = rewards(greedy=True)
            result = {
                "model": model_path,
                "task": cfg.task.name,
                "prompts": len(prompts),
                "accuracy": greedy_share(greedy),
            }
            if by_task := greedy_share_by_task(prompts, greedy):
                result["task_accuracy"] = by_task
            if n:
                k = cfg.trainer.eval_pass_k or n
                result[f"mean@{n}"], result[f"pass@{k}"] = sampled_scores(rewards(greedy=False), k)
            return result
        finally:
            scorer.pool.close()
            loop.close()


class HeldOutSet:
    """An extra held-out set (`task.eval_sets`): its prompts, and a scorer of its own task in
    scorer processes killed at their deadline (the reward workers know only the job's task)."""

    def __init__(self, cfg: EvalSetConfig, plugin_timeout_s: float):
        from groupflow.reward_workers.scorer import Scorer
        from groupflow.reward_workers.tasks import make_task

        self.name = cfg.name
        self.prompts = make_task(cfg.task, cfg.options).eval_prompts(cfg.size)
        self.scorer = Scorer(cfg.task, cfg.options, timeout_s=plugin_timeout_s)

    def rewards(self, groups: list) -> list[list[float]]:
        return [sg.rewards for sg in self.scorer.score_groups(groups)]

    def close(self) -> None:
        self.scorer.pool.close()
