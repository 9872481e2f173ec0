"""The `trainer` section (steps, seeds, evaluation, checkpoints, the run directory) and the
`metrics` section (Prometheus, the progress bar, experiment trackers)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictInt, field_validator, model_validator

from groupflow.config.base import FloatSetting, Section

MAX_SEED = (1 << 31) - 1


class TrainerConfig(Section):
    """The run: steps, seeds, evaluation, checkpoints and where it is written."""

    eval_samples: StrictInt = Field(
        0,
        ge=0,
        le=1024,
        description="sampled answers per held-out prompt (rollout.sampling) for mean@n and "
        "pass@k besides greedy accuracy; 0 = greedy only",
    )
    eval_pass_k: StrictInt | None = Field(
        None,
        ge=1,
        description="k of pass@k, the unbiased estimator of Chen et al. 2021 (arXiv "
        "2107.03374); at most eval_samples; unset = eval_samples",
    )
    log_samples_every: StrictInt = Field(
        0, ge=0, description="write runs/<name>/samples/step_<N>.jsonl every N steps; 0 = never"
    )
    log_samples_shown: StrictInt = Field(
        4, ge=0, description="responses of a logged step shown as a table in the progress output"
    )
    steps: StrictInt = Field(
        20, ge=1, description="training steps (one weight update and sync each)"
    )
    seed: StrictInt = Field(
        0,
        ge=0,
        # each engine seeds numpy with trainer.seed plus its slot (vLLM's set_random_seed),
        # which numpy refuses outside [0, 2**32): past this, an engine's start would fail
        le=MAX_SEED,
        description="seed of the learner, the engines, the prompt order and the sync probe "
        f"(0 to {MAX_SEED})",
    )
    output_dir: str = Field(
        "runs",
        description="where run directories are written (output_dir/run_name); on a cluster a "
        "path on shared storage, absolute",
    )
    run_name: str = Field(
        "run",
        description="the run directory's name under output_dir: one path component, not "
        "hidden (no '/', no leading '.'); unset in a config file = the file's name less its "
        "suffix (job.yaml: job; the built-in quickstart: quickstart)",
    )
    max_staleness: StrictInt = Field(
        0,
        ge=0,
        le=8,
        description="policy versions a trained sample may lag behind the learner: 0 = "
        "on-policy (generation and learning take turns); k > 0 = the engines generate up to "
        "k steps ahead while the learner trains, with the off-policy correction "
        "(algorithm.off_policy)",
    )
    eval_every: StrictInt = Field(
        0, ge=0, description="greedy eval every N steps; 0 = start and end only"
    )
    checkpoint_every: StrictInt = Field(
        0,
        ge=0,
        description="save a checkpoint (ZeRO-3 model and optimizer shards, the driver's state) "
        "to <run>/checkpoints/step_<N>/ every N steps; 0 = none",
    )
    keep_checkpoints: StrictInt = Field(2, ge=1, description="the newest K checkpoints are kept")
    save_hf_every: StrictInt = Field(
        0,
        ge=0,
        description="also save the policy in Hugging Face format as step_<N>/hf every N steps "
        "(a multiple of checkpoint_every); 0 = never",
    )
    save_merged: bool = Field(
        False,
        description="with learner.lora: the final model and each save_hf_every save also hold "
        "the model with the adapters merged into its weights (merged/), beside the adapter in "
        "PEFT's format",
    )
    resume: str | None = Field(
        None,
        description="never: a fresh run; auto: continue from the run's newest checkpoint if "
        "there is one; latest: continue from it (there must be one); or a checkpoint directory. "
        "Unset = never for `groupflow train`, auto for `groupflow submit`",
    )
    stop_timeout_s: FloatSetting = Field(
        60.0,
        gt=0,
        le=86400,
        description="after a stop (Ctrl-C, SIGTERM, `groupflow stop`), seconds the step in "
        "flight may still wait for its samples; later it is abandoned and the job ends at the "
        "step before (a step whose samples are in always finishes)",
    )
    max_restarts: StrictInt = Field(
        3,
        ge=0,
        description="one budget for engines and learner ranks: a dead engine replaced or the "
        "learner ranks rebuilt from the newest checkpoint is one restart, and more than this "
        "many restarts without a new step trained between end the job",
    )

    @field_validator("run_name")
    @classmethod
    def _one_path_component(cls, name: str) -> str:
        # The run directory is output_dir/run_name: a name of several components, or one
        # that is empty or '..', would put it elsewhere; a hidden one could be a checkpoint's
        # staging or a lock file of groupflow's.
        if not name or name.startswith(".") or any(c in name for c in "/\\\0"):
            raise ValueError("must be one directory name: not empty, no '/', not hidden")
        return name

    @model_validator(mode="after")
    def _check_intervals(self) -> TrainerConfig:
        if self.eval_pass_k is not None and self.eval_pass_k > self.eval_samples:
            raise ValueError(
                f"eval_pass_k ({self.eval_pass_k}) needs at least as many eval_samples "
                f"({self.eval_samples})"
            )
        if self.save_hf_every and (
            not self.checkpoint_every or self.save_hf_every % self.checkpoint_every
        ):
            raise ValueError(
                f"save_hf_every ({self.save_hf_every}) must be a multiple of "
                f"checkpoint_every ({self.checkpoint_every})"
            )
        return self


class MetricsConfig(Section):
    """Monitoring: Prometheus, the progress bar and experiment trackers."""

    prometheus_port: StrictInt | None = Field(
        None, ge=0, le=65535, description="unset = no endpoint"
    )
    prometheus_addr: str = Field("0.0.0.0", description="interface to serve metrics on")
    progress: bool = Field(True, description="progress bar on a terminal")
    loggers: list[Literal["tensorboard", "wandb"]] = Field(
        default_factory=list,
        description="experiment trackers that also get every step record (optional extras: "
        "pip install 'groupflow[tensorboard]' or 'groupflow[wandb]')",
    )
    wandb_project: str = Field("groupflow", min_length=1, description="W&B project name")
    wandb_mode: Literal["online", "offline"] = Field(
        "online", description="offline: W&B keeps the run under runs/<name>/wandb (wandb sync)"
    )
