"""The `reward` section: the reward workers, the verifier they run and the overlong penalty."""

from __future__ import annotations

from pydantic import Field, StrictInt

from groupflow.config.base import FloatSetting, RewardWorkerResources, Section


class OverlongPenaltyConfig(Section):
    """DAPO's soft penalty of responses near the length limit."""

    buffer_tokens: StrictInt = Field(
        ge=1,
        description="the last buffer_tokens before rollout.sampling.max_tokens, over which the "
        "penalty grows linearly from 0 to max_penalty (DAPO's L_cache)",
    )
    max_penalty: FloatSetting = Field(
        1.0, gt=0, le=10, description="the penalty of a response cut at the limit"
    )


class RewardConfig(Section):
    """Scoring: the reward workers and the verifier they run."""

    num_workers: StrictInt = Field(
        2,
        ge=1,
        description="reward workers (Ray actors) that score responses; groupflow scale changes it",
    )
    verifier: str | None = Field(
        None, description="unset = the task's own verifier; or a plugin 'module:function' / file.py"
    )
    timeout_s: FloatSetting = Field(
        30.0,
        gt=0,
        le=86_400,
        allow_inf_nan=False,
        description="seconds a batch of groups may take to score from its submission: "
        "responses still unscored then get reward 0 (a timeout), so a stuck verifier never "
        "stalls a step longer than this (docs/sandbox.md)",
    )
    plugin_timeout_s: FloatSetting = Field(
        10.0,
        gt=0,
        le=86_400,
        allow_inf_nan=False,
        description="seconds one call of a reward plugin may take; its scorer process is "
        "killed and replaced past that (built-in tasks use their own timeout_s option)",
    )
    max_retries: StrictInt = Field(
        2, ge=0, le=100, description="retries of a batch whose reward worker died"
    )
    scorer_processes: StrictInt = Field(
        2,
        ge=1,
        le=64,
        description="scorer processes per reward worker: verifier calls in flight at once, "
        "each in a process killed and replaced at its deadline",
    )
    resources: RewardWorkerResources = Field(default_factory=RewardWorkerResources)
    max_unscored_steps: StrictInt = Field(
        3,
        ge=1,
        le=1000,
        description="steps in a row whose responses were all unscored (reward workers timed "
        "out or were never placed) before the job stops; such a step is never trained on",
    )
    max_infra_failure_share: FloatSetting = Field(
        0.2,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="share of a step's responses that may fail for a reason not the model's "
        "(an environment or tool worker, a verifier that failed or timed out) before the job "
        "warns, once; past it in 3 steps in a row, the job stops. Such responses are masked "
        "either way: out of their group's statistics and the loss (docs/agents.md)",
    )
    overlong_penalty: OverlongPenaltyConfig | None = Field(
        None,
        description="DAPO's soft overlong punishment (arXiv 2503.14476), added to the "
        "verifier's reward; unset = none",
    )
