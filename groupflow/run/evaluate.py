"""`groupflow eval`: the held-out scores of a model directory, or of a LoRA adapter served on
its base, on one vLLM engine in this process. The prompts are vetted as a run vets them
(groupflow/run/job_prompts.py), and the scores are a training job's (groupflow/loop/held_out.py)."""

from __future__ import annotations

import asyncio

from groupflow.actors.tools import in_process_run_code
from groupflow.config import Config
from groupflow.core.adapters import engine_max_rank
from groupflow.loop.held_out import Scores, held_out_scores
from groupflow.observe.environment_errors import environment_verdict
from groupflow.observe.progress import PhaseProgress, heartbeat
from groupflow.reward_workers.scorer import Scorer
from groupflow.reward_workers.tasks import make_task
from groupflow.rollout.engine import EngineLora, RolloutEngine, engine_settings
from groupflow.run.eval_model import EvalModel
from groupflow.run.job_prompts import vet_prompts


def evaluate_model(cfg: Config, model: EvalModel) -> dict:
    """One in-process vLLM engine on the task's held-out prompts; the answers are scored as
    the reward workers score them, in scorer processes killed at their deadline. `model` is a
    model directory or a LoRA adapter saved in PEFT's format (served on its base), checked by
    groupflow/run/eval_model.py before this module is imported."""
    adapter, base = model.adapter, model.base
    vet_prompts(cfg, base)  # the template vetted, prompts too long left out
    prompts = make_task(cfg.task.name, cfg.task.options).eval_prompts(cfg.task.eval_size)
    settings = engine_settings(cfg, base, seed=cfg.trainer.seed)
    if adapter is not None:
        settings.lora = EngineLora(engine_max_rank(max(adapter.ranks)), adapter.config)
    # no tool pool here: the python tool's sandboxes start from this process
    python = "python" in cfg.agent_tools()
    run_code = in_process_run_code(cfg.agent.allow_weak_sandbox) if python else None
    # the engine's start and the answers block: a heartbeat says where a long evaluation is
    with heartbeat(PhaseProgress("evaluation")) as progress:
        progress.update(note="starting the engine")
        engine = RolloutEngine(settings, run_code)
        if adapter is not None:
            engine.load_weights(model.tensors, version=0)
        reward = cfg.reward
        scorer = Scorer(
            cfg.task.name,
            cfg.task.options,
            plugin=reward.verifier,
            timeout_s=reward.plugin_timeout_s,
            processes=reward.scorer_processes,
        )
        loop = asyncio.new_event_loop()  # the engine's requests are coroutines
        trainer = cfg.trainer
        n = trainer.eval_samples
        answered: list = []  # every answer, for what the environment did to them

        def answers(greedy: bool) -> list:
            groups = loop.run_until_complete(
                engine.complete(prompts, n, cfg.rollout.sampling, greedy)
            )
            answered.extend(groups)
            return groups

        def rewards(groups: list) -> list[list[float]]:
            return [sg.rewards for sg in scorer.score_groups(groups)]

        try:
            scores = held_out_scores(
                prompts, answers, rewards, n, trainer.eval_pass_k, progress.update
            )
        finally:
            scorer.pool.close()
            loop.close()
    about = {"model": model.path, "task": cfg.task.name, "prompts": len(prompts)}
    verdict = environment_verdict(
        answered, cfg.agent.trajectory_setting
    )  # most answers failed by it: no scores
    return about | eval_keys(scores, n, trainer.eval_pass_k or n) | verdict


def eval_keys(scores: Scores, n: int, k: int) -> dict:
    """The scores as `groupflow eval` prints them: mean@n and pass@k named with their n and k."""
    names = {"mean_at_n": f"mean@{n}", "pass_at_k": f"pass@{k}"}
    return {names.get(key, key): value for key, value in scores.items()}
