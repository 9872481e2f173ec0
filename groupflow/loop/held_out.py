"""Held-out scores, in one place for a training job and for `groupflow eval` alike: greedy
accuracy (the number `summary.json` reports), and with `trainer.eval_samples` = n also mean@n
and pass@k of n sampled answers per prompt (`held_out_scores`); with greedy accuracy by task in
a mixture.

A training job evaluates between steps (`HeldOutEvaluation`, blocking) on the task's own
held-out set (and each task of a mixture) and on each `task.eval_sets` set. The job's engines
answer; the reward workers score the task's own set, as in training, so a hostile answer cannot
stall the driver, and the job's pipeline waits for those scores in its one wait, its chunks
flowing meanwhile; each extra set has a scorer of its own (`HeldOutSet`). `groupflow eval`
(groupflow/run/evaluate.py) answers on one engine in its own process and scores in scorer
processes, with the same `held_out_scores`.

Its checkpoint state is the scores before training, which summary.json reports beside the
final ones however often the run was resumed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from groupflow.config import Config, EvalSetConfig
from groupflow.core.records import Prompt, SampledGroup
from groupflow.loop.pipeline import Pipeline
from groupflow.observe.progress import PhaseProgress, heartbeat
from groupflow.reward_workers.scorer import Scorer
from groupflow.reward_workers.tasks import make_task

EVAL_CHUNK = -1  # the reward pool's batch id for held-out answers (chunks count from 0)

Scores = dict[str, float | dict[str, float]]


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


def held_out_scores(
    prompts: list[Prompt],
    answers: Callable[[bool], list[SampledGroup]],
    score: Callable[[list[SampledGroup]], list[list[float]]],
    samples: int,
    pass_k: int | None,
    doing: Callable[..., None],
    of: str | None = None,
) -> Scores:
    """`accuracy` of the greedy answers (`task_accuracy` by task in a mixture), and with
    `samples` = n > 0 `mean_at_n` and `pass_at_k` (k = `pass_k`, or n) of n sampled answers.
    `answers(greedy)` answers every prompt, `score` gives each answer's reward, `doing` says
    what is under way (groupflow/observe/progress.py), of `of` when given."""
    about = f"{len(prompts)} prompts" + ("" if of is None else f" of {of}")
    doing(note=f"greedy answers to {about}")
    greedy = score(answers(True))
    scores: Scores = {"accuracy": greedy_share(greedy)}
    if by_task := greedy_share_by_task(prompts, greedy):
        scores["task_accuracy"] = by_task
    if samples:
        doing(note=f"{samples} sampled answers to {about}")
        rewards = score(answers(False))
        scores["mean_at_n"], scores["pass_at_k"] = sampled_scores(rewards, pass_k or samples)
    return scores


class HeldOutSet:
    """An extra held-out set (`task.eval_sets`): its prompts, and a scorer of its own task in
    scorer processes killed at their deadline (the reward workers know only the job's task)."""

    def __init__(self, cfg: EvalSetConfig, plugin_timeout_s: float):
        self.name = cfg.name
        self.prompts = make_task(cfg.task, cfg.options).eval_prompts(cfg.size)
        self.scorer = Scorer(cfg.task, cfg.options, timeout_s=plugin_timeout_s)

    def rewards(self, groups: list) -> list[list[float]]:
        return [sg.rewards for sg in self.scorer.score_groups(groups)]

    def close(self) -> None:
        self.scorer.pool.close()


class HeldOutEvaluation:
    def __init__(
        self,
        cfg: Config,
        prompts: list[Prompt],
        pipeline: Pipeline,
        held_out_sets: Sequence[HeldOutSet],
    ):
        self.cfg = cfg
        self.prompts = prompts  # the task's own held-out set
        self.pipeline = pipeline
        self.generators = pipeline.generators
        self.held_out_sets = held_out_sets
        self.before_training: dict = {}  # every score before the first step (score_before)

    def scores(self) -> Scores:
        """The task's own set's scores (eval_*, with eval_task_accuracy by task in a mixture)
        and each extra set's (eval_set_*, by name). A long evaluation says where it is
        (groupflow/observe/progress.py)."""
        with heartbeat(PhaseProgress("held-out evaluation")) as progress:
            own = self._scores(self.prompts, self._pool, progress.update, "the task")
            out = {f"eval_{key}": value for key, value in own.items()}
            for held_out in self.held_out_sets:
                of_set = f"eval set {held_out.name}"
                for key, value in self._scores(
                    held_out.prompts, held_out.rewards, progress.update, of_set
                ).items():
                    out.setdefault(f"eval_set_{key}", {})[held_out.name] = value
        return out

    def _scores(
        self,
        prompts: list[Prompt],
        score: Callable[[list[SampledGroup]], list[list[float]]],
        doing: Callable[..., None],
        of: str,
    ) -> Scores:
        trainer = self.cfg.trainer
        return held_out_scores(
            prompts,
            lambda greedy: self._answers(prompts, greedy),
            score,
            trainer.eval_samples,
            trainer.eval_pass_k,
            doing,
            of,
        )

    def _answers(self, prompts: list[Prompt], greedy: bool) -> list[SampledGroup]:
        """A group per prompt; where an engine dies answering, the engines there are then
        asked again (each death is a restart: the job's budget bounds this)."""
        while True:
            self.pipeline.wait_for_engines()  # new engines get the weights first
            n, sampling = self.cfg.trainer.eval_samples, self.cfg.rollout.sampling
            groups = self.generators.complete(prompts, n, sampling, greedy, self.pipeline.version)
            if groups is not None:
                return groups

    def _pool(self, groups: list[SampledGroup]) -> list[list[float]]:
        self.pipeline.rewards.submit(groups, EVAL_CHUNK)
        return [sg.rewards for sg in self.pipeline.scores_of(EVAL_CHUNK)]

    def score_before(self) -> dict[str, float | dict[str, float]]:
        """`scores` before the first step, kept as `before_training`."""
        self.before_training = self.scores()
        return self.before_training

    def state_dict(self) -> dict:
        return self.before_training

    def load_state_dict(self, state: dict) -> None:
        self.before_training = state

    def close(self) -> None:
        for held_out in self.held_out_sets:
            held_out.close()
