"""A training job's held-out evaluation: greedy accuracy, and with `trainer.eval_samples` = n
also mean@n and pass@k of n sampled answers per prompt (groupflow/evaluate.py has the scores),
of the task's own held-out set (and of each task of a mixture) and of each `task.eval_sets` set.

The job's engines answer; the reward workers score the task's own set, as in training, so a
hostile answer cannot stall the driver, and the job's pipeline waits for those scores in its
one wait, its chunks flowing meanwhile; each extra set has a scorer of its own
(evaluate.HeldOutSet). Blocking: the job evaluates between steps.

Its checkpoint state is the scores before training, which summary.json reports beside the
final ones however often the run was resumed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from groupflow.config import Config
from groupflow.evaluate import HeldOutSet, greedy_share, greedy_share_by_task, sampled_scores
from groupflow.pipeline import Pipeline
from groupflow.progress import PhaseProgress, heartbeat
from groupflow.records import Prompt, SampledGroup

EVAL_CHUNK = -1  # the reward pool's batch id for held-out answers (chunks count from 0)


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

    def scores(self) -> dict[str, float | dict[str, float]]:
        """The task's own set's scores (eval_*, with eval_task_accuracy by task in a mixture)
        and each extra set's (eval_set_*, by name). A long evaluation says where it is
        (groupflow/progress.py)."""
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
    ) -> dict[str, float | dict[str, float]]:
        trainer = self.cfg.trainer
        doing(note=f"greedy answers to {len(prompts)} prompts of {of}")
        greedy = score(self._answers(prompts, greedy=True))
        scores: dict[str, float | dict[str, float]] = {"accuracy": greedy_share(greedy)}
        if by_task := greedy_share_by_task(prompts, greedy):
            scores["task_accuracy"] = by_task
        if trainer.eval_samples:
            k = trainer.eval_pass_k or trainer.eval_samples
            doing(note=f"{trainer.eval_samples} sampled answers to {len(prompts)} prompts of {of}")
            rewards = score(self._answers(prompts, greedy=False))
            scores["mean_at_n"], scores["pass_at_k"] = sampled_scores(rewards, k)
        return scores

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
