"""The job configuration: typed, validated pydantic models, loaded from YAML plus `--set`.

Every section forbids unknown keys, so a typo stops the job before anything starts,
with a one-line message naming the key (`ConfigError`).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from groupflow.errors import UserError, first_line
from groupflow.presets import PRESETS

# Bounds on what a config's YAML may expand to: a config is a few hundred keys, so these are
# far above any real one and far below what exhausts memory or Python's recursion.
MAX_CONFIG_BYTES = 1 << 20
MAX_YAML_DEPTH = 64
MAX_YAML_NODES = 100_000  # after aliases are expanded, as validation expands them
MAX_INT_DIGITS = 100
# Every integer setting fits a signed 64-bit integer (what seeds and counts reach torch as).
INT64 = 1 << 63


class ConfigError(UserError, ValueError):
    """A config problem, phrased as one line that names the offending key."""


def _not_a_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("a boolean is not a number")
    return value


# The type of every float setting: what pydantic reads as a float (YAML's 1e-5 is a string),
# but never a boolean, which it would read as 1.0. Integer settings are StrictInt: no
# boolean, no float, no string.
FloatSetting = Annotated[float, BeforeValidator(_not_a_bool)]


def _unfit_number(value: Any) -> str | None:
    """Where in a setting's value a number is NaN, infinite or past 64 bits ('' = the value
    itself), or None when every number in it is fine."""
    if isinstance(value, float) and not math.isfinite(value):
        return ""
    if isinstance(value, int) and not isinstance(value, bool) and not -INT64 <= value < INT64:
        return ""
    if isinstance(value, BaseModel):  # a nested section checks its own settings
        return None
    items = value.items() if isinstance(value, dict) else None
    if isinstance(value, list | tuple):
        items = enumerate(value)
    for key, item in items or ():
        where = _unfit_number(item)
        if where is not None:
            return f"[{key!r}]{where}" if isinstance(key, str) else f"[{key}]{where}"
    return None


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # One rule for the whole schema, fields added later included: every number in a setting
    # (a float field, a tuple, a task's free-form options) is finite and fits 64 bits.
    @field_validator("*", mode="after")
    @classmethod
    def _finite_numbers(cls, value: Any) -> Any:
        where = _unfit_number(value)
        if where is not None:
            place = f" at {where}" if where else ""
            raise ValueError(f"numbers must be finite and fit in 64 bits{place}")
        return value


class Resources(Section):
    """Ray resources for one actor. CPU machines use fractional CPUs; GPU clusters set num_gpus."""

    num_cpus: FloatSetting = Field(
        1.0, ge=0, description="CPUs Ray reserves for the actor (fractions allowed)"
    )
    num_gpus: FloatSetting = Field(
        0.0, ge=0, description="GPUs Ray reserves for the actor; 0 = runs on CPU"
    )
    torch_threads: StrictInt = Field(1, ge=1, description="intra-op threads for torch in the actor")
    cpu_cores: list[Annotated[StrictInt, Field(ge=0)]] = Field(
        default_factory=list,
        description="cores the actor's threads are pinned to (os.sched_setaffinity; empty: "
        "not pinned), e.g. to keep generation and learning off each other's cores",
    )
    custom: dict[str, Annotated[FloatSetting, Field(ge=0)]] = Field(
        default_factory=dict,
        description="custom Ray resources, e.g. {groupflow_rollout: 1} to pin a worker group",
    )


# Each pool's defaults, as a Resources of its own: a `resources` setting given in part (e.g.
# only `custom`, to pin the pool to a worker group) keeps the pool's defaults for every key it
# leaves out, rather than Resources' 1 CPU, which would starve a CPU cluster of room.
class EngineResources(Resources):
    num_cpus: FloatSetting = Field(0.5, ge=0, description="CPUs Ray reserves for each engine")


class RewardWorkerResources(Resources):
    num_cpus: FloatSetting = Field(
        0.25, ge=0, description="CPUs Ray reserves for each reward worker"
    )


class LearnerRankResources(Resources):
    num_cpus: FloatSetting = Field(0.5, ge=0, description="CPUs Ray reserves for each learner rank")


class ModelConfig(Section):
    """The policy model: a local Hugging Face model directory, or the built-in one."""

    path: str | None = Field(
        None,
        description="local Hugging Face model directory, or a Hugging Face model id "
        "(org/name[@revision], from the hub cache, downloaded when not there; docs/hub.md); "
        "unset = the built-in quickstart model",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="the weights' dtype in the engines and the learner (one dtype, so every "
        "weight sync is bit-exact): bfloat16 for a real model on GPUs (the learner keeps fp32 "
        "master weights); float32 on CPU",
    )
    warm_start_steps: StrictInt = Field(
        300, ge=0, description="supervised warm-start steps for the built-in model (cached)"
    )


class EvalSetConfig(Section):
    """One more held-out set, evaluated beside the job's own."""

    name: str = Field(
        pattern=r"^[A-Za-z0-9_.-]+$", description="its label in the metrics (eval_set_*)"
    )
    task: str = Field(description="a built-in task whose held-out prompts make the set")
    options: dict[str, Any] = Field(default_factory=dict, description="that task's settings")
    size: StrictInt = Field(256, ge=1, description="held-out prompts in the set")

    @model_validator(mode="after")
    def _known_task(self) -> EvalSetConfig:
        from groupflow.reward_workers.tasks import TASKS

        if self.task not in TASKS or self.task == "mixture":
            raise ValueError(
                f"unknown task {self.task!r}; choose one of {sorted(set(TASKS) - {'mixture'})}"
            )
        return self


class TaskConfig(Section):
    """What the model is trained on: the task that makes the prompts and scores the responses."""

    name: str = Field(
        "arithmetic",
        description="a built-in task (see reward_workers.tasks); a list of tasks under `task` "
        "mixes several in one job, each with a weight",
    )
    options: dict[str, Any] = Field(default_factory=dict, description="task-specific settings")
    eval_size: StrictInt = Field(256, ge=1, description="held-out prompts for greedy accuracy")
    chat_template: str = Field(
        "auto",
        min_length=1,
        description="how prompts are rendered: 'auto' = the tokenizer's chat template when it "
        "has one (with a generation prompt), 'none' = raw text, or a Jinja template file",
    )
    system_prompt: str | None = Field(
        None, description="a system turn before every prompt (needs a chat template)"
    )
    seed: StrictInt = Field(
        1234, description="seed of the task's prompt stream and of its held-out split"
    )
    eval_sets: list[EvalSetConfig] = Field(
        default_factory=list,
        description="more held-out sets, evaluated with the job's own (e.g. another task's "
        "problems); each is reported under its name",
    )

    @model_validator(mode="after")
    def _check_mixture(self) -> TaskConfig:
        names = [s.name for s in self.eval_sets]
        if len(set(names)) < len(names):
            raise ValueError(f"eval_sets: names must differ (got {names})")
        if self.name == "mixture":
            from groupflow.reward_workers.tasks.mixture import mixture_entries

            mixture_entries(self.options.get("tasks"))
        return self


class SamplingConfig(Section):
    """How the engines sample responses (vLLM's SamplingParams)."""

    temperature: FloatSetting = Field(1.0, gt=0, le=2, description="vLLM accepts (0, 2]")
    top_p: FloatSetting = Field(
        1.0, gt=0, le=1, description="nucleus sampling: the likeliest tokens of this total mass"
    )
    top_k: StrictInt = Field(0, ge=0, description="sample from the k likeliest tokens; 0 = all")
    min_p: FloatSetting = Field(
        0.0, ge=0, le=1, description="drop tokens below min_p x the likeliest token's probability"
    )
    max_tokens: StrictInt = Field(
        1024,
        ge=1,
        description="response length limit in tokens (a longer response is cut, finish_reason "
        "'length'); with a multi-turn job, of each model turn",
    )
    stop: list[str] = Field(
        default_factory=list,
        description="strings that end a response (kept in its text and token ids, so the "
        "learner trains the tokens that were sampled)",
    )
    ignore_eos: bool = Field(
        False,
        description="generate past the end-of-text token, to max_tokens or a stop string: for "
        "benchmarks and tests that need responses of a known length, never for training",
    )
    seed: StrictInt | None = Field(
        None,
        description="seeds each request from (seed, prompt, policy version): a step's samples "
        "repeat across runs and restarts; unset = the engine's own random stream",
    )

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, stop: list[str]) -> list[str]:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        return stop


class AutoscaleConfig(Section):
    """Engines added while the learner waits for generation, removed while they sit idle
    (groupflow/scaling.py: AutoscalePolicy)."""

    min_engines: StrictInt = Field(1, ge=1, description="never fewer engines than this")
    max_engines: StrictInt = Field(ge=1, description="never more engines than this")
    patience: StrictInt = Field(
        2,
        ge=1,
        description="steps in a row a signal must hold before an engine is added or removed",
    )

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscaleConfig:
        if self.min_engines > self.max_engines:
            raise ValueError(
                f"min_engines ({self.min_engines}) must not exceed max_engines ({self.max_engines})"
            )
        return self


class RolloutConfig(Section):
    """Generation: the vLLM engines, groups and their sampling."""

    num_engines: StrictInt = Field(
        1, ge=1, description="vLLM engines (Ray actors) that sample; groupflow scale changes it"
    )
    autoscale: AutoscaleConfig | None = Field(
        None,
        description="off (null) by default; {min_engines, max_engines}: add an engine when the "
        "learner waits for generation, remove one when the engines sit idle, within the bounds "
        "(needs weight_transport object_store; num_engines is the starting count)",
    )
    group_size: StrictInt = Field(8, ge=1, description="G: responses sampled per prompt")
    prompts_per_step: StrictInt = Field(
        32, ge=1, description="groups (prompts, each with group_size responses) trained per step"
    )
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    resources: EngineResources = Field(default_factory=EngineResources)
    kv_cache_gib: FloatSetting = Field(
        1.0, gt=0, le=1 << 20, description="KV cache size on CPU (VLLM_CPU_KVCACHE_SPACE)"
    )
    gpu_memory_utilization: FloatSetting = Field(
        0.5,
        gt=0,
        le=1,
        description="share of each engine GPU's memory vLLM may take (weights and KV cache); "
        "raise it (e.g. 0.85) where an engine has its GPU to itself",
    )
    max_model_len: StrictInt = Field(
        2048,
        ge=8,
        description="an engine's context in tokens: a prompt's tokens plus its max_tokens must "
        "fit, or the prompt is left out (at most 1% of a dataset) or the job refused; at most "
        "the model's own context (max_position_embeddings)",
    )
    enforce_eager: bool | None = Field(
        None,
        description="run the engine's model eagerly (true) or let vLLM capture CUDA graphs of "
        "its decode steps and compile it (false); null (the default): eagerly on CPU, CUDA "
        "graphs on GPUs (resources.num_gpus > 0)",
    )
    max_num_seqs: StrictInt | None = Field(
        None,
        ge=1,
        description="sequences an engine runs at once (a prompt's request of n = group_size "
        "counts group_size); null: vLLM's default for the device",
    )
    enable_prefix_caching: bool | None = Field(
        None,
        description="reuse the KV cache of prompt prefixes the engine computed already (a "
        "group's responses share their prompt); null: vLLM's default (on). Every weight load "
        "empties the cache",
    )
    tensor_parallel_size: StrictInt = Field(
        1,
        ge=1,
        le=64,
        description="devices one engine spans: vLLM's multiprocess executor runs a worker per "
        "device (per share of the actor's cores on CPU), each loading its own shard of every "
        "weight sync; on GPUs resources.num_gpus must equal it",
    )
    partial_rollout: bool | None = Field(
        None,
        description="load a weight sync while requests run (they stop for the load and go on "
        "under the new weights, each token labelled with the version that sampled it; "
        "staleness counts from a group's oldest token) instead of letting them finish under "
        "the old weights first while new requests wait; null: on when "
        "trainer.max_staleness > 0 (at 0 no request runs across a sync)",
    )
    weight_transport: Literal["object_store", "collective"] = Field(
        "object_store",
        description="how new weights reach the engines: Ray's object store, or a broadcast "
        "from learner rank 0 (NCCL on GPUs, gloo on CPUs)",
    )
    weight_bucket_mb: StrictInt = Field(
        64,
        ge=1,
        description="size of a weight-sync bucket in MiB (whole transformer layers up to this "
        "size; a larger layer is a bucket of its own): both transports send the model bucket by "
        "bucket, so learner rank 0 holds at most two buckets, never a second copy of the model",
    )

    @model_validator(mode="after")
    def _check_tensor_parallel(self) -> RolloutConfig:
        tp, res = self.tensor_parallel_size, self.resources
        if tp > 1 and res.num_gpus and res.num_gpus != tp:
            raise ValueError(
                f"tensor_parallel_size ({tp}) must equal resources.num_gpus ({res.num_gpus:g}): "
                "an engine's actor holds the devices of its workers"
            )
        if tp > 1 and not res.num_gpus and res.cpu_cores and len(res.cpu_cores) < tp:
            raise ValueError(
                f"tensor_parallel_size ({tp}) needs as many cores in resources.cpu_cores "
                f"({res.cpu_cores}): each CPU worker runs on cores of its own"
            )
        return self

    @model_validator(mode="after")
    def _check_autoscale(self) -> RolloutConfig:
        auto = self.autoscale
        if auto is None:
            return self
        if self.weight_transport != "object_store":
            raise ValueError(
                "autoscale: needs weight_transport object_store (the collective transport's "
                "process group cannot take new engines)"
            )
        if not auto.min_engines <= self.num_engines <= auto.max_engines:
            raise ValueError(
                f"num_engines ({self.num_engines}) must lie within autoscale's bounds "
                f"[{auto.min_engines}, {auto.max_engines}]"
            )
        return self


class AgentConfig(Section):
    """Multi-turn trajectories with tools (docs/agents.md): on when the job has tools or an
    environment. Each model turn is one request; the environment's answer (tool results) is
    rendered once and appended, and trained as context only (docs/algorithms.md, 'Observation
    tokens')."""

    tools: list[str] | None = Field(
        None,
        description="tools the model may call: 'calculator', 'python' (sandboxed, in the tool "
        "pool) or 'module:name' of your own; unset = the task's own (tool_arithmetic: "
        "calculator), [] = none",
    )
    environment: str | None = Field(
        None,
        description="'module:name' of a factory called with each trajectory's prompt, whose "
        "step(turn_text) returns the messages to insert or None to end; unset = run the tool "
        "calls (rollout/trajectory.py ToolEnvironment)",
    )
    tool_parser: str = Field(
        "hermes",
        min_length=1,
        description="vLLM's tool parser that reads calls from a turn: 'hermes' for the "
        "Hermes/Qwen <tool_call> JSON format, or any other vLLM registers",
    )
    max_turns: StrictInt = Field(4, ge=1, le=64, description="model turns per trajectory")
    max_total_tokens: StrictInt | None = Field(
        None,
        ge=2,
        description="a trajectory's token budget, observations included (DAPO's overlong "
        "penalty counts against it); unset = what the context leaves; each turn is limited by "
        "rollout.sampling.max_tokens",
    )
    deadline_s: FloatSetting = Field(
        300.0, gt=0, le=86_400, description="wall-clock limit of one trajectory"
    )
    tool_timeout_s: FloatSetting = Field(10.0, gt=0, le=3600, description="limit of one tool call")
    tool_output_chars: StrictInt = Field(
        2000, ge=16, le=1_000_000, description="a tool result is cut to this many characters"
    )
    tool_workers: StrictInt = Field(
        1, ge=1, le=4096, description="tool-pool actors that run the python tool's sandboxes"
    )
    allow_weak_sandbox: bool = Field(
        False,
        description="run the python tool where the sandbox lacks its kernel layers "
        "(docs/sandbox.md); refused otherwise",
    )

    @field_validator("tools")
    @classmethod
    def _known_tools(cls, tools: list[str] | None) -> list[str] | None:
        from groupflow.rollout.tools import BUILTIN_TOOLS

        for tool in tools or ():
            if tool not in BUILTIN_TOOLS and ":" not in tool:
                raise ValueError(
                    f"{tool!r} is neither a built-in tool ({', '.join(BUILTIN_TOOLS)}) nor "
                    "'module:name' of your own"
                )
        return tools


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
    overlong_penalty: OverlongPenaltyConfig | None = Field(
        None,
        description="DAPO's soft overlong punishment (arXiv 2503.14476), added to the "
        "verifier's reward; unset = none",
    )


class OptimizerConfig(Section):
    """The learner's optimizer and learning-rate schedule."""

    name: Literal["adamw"] = Field("adamw", description="the optimizer: AdamW (the only one)")
    lr: FloatSetting = Field(1e-5, gt=0, le=1, description="peak learning rate (after the warmup)")
    betas: tuple[
        Annotated[FloatSetting, Field(ge=0, lt=1)], Annotated[FloatSetting, Field(ge=0, lt=1)]
    ] = Field((0.9, 0.999), description="AdamW's (beta1, beta2): decay of the gradient's moments")
    weight_decay: FloatSetting = Field(
        0.0, ge=0, le=1, description="AdamW's decoupled weight decay"
    )
    max_grad_norm: FloatSetting = Field(
        1.0, gt=0, description="gradients are clipped to this global norm before each update"
    )
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="learning rate after the warmup: constant, or a linear or cosine decay "
        "towards 0 at trainer.steps (transformers' schedules), per training step",
    )
    warmup_steps: StrictInt = Field(
        0, ge=0, description="training steps over which the rate rises linearly to lr"
    )


class Zero3Config(Section):
    """ZeRO-3's parameter handling; each unset knob comes from the table in
    docs/zero3_tuning.md, chosen by the model's parameter count and the number of ranks."""

    param_persistence_threshold: StrictInt | None = Field(
        None,
        ge=0,
        description="parameters of at most this many elements stay whole on every rank: never "
        "gathered, so their modules pay no gather hooks; costs their full size on each rank. "
        "Unset: from docs/zero3_tuning.md's table",
    )
    prefetch_bucket_size: StrictInt | None = Field(
        None,
        ge=0,
        description="elements of the parameters gathered ahead of the module that needs them. "
        "Unset: from docs/zero3_tuning.md's table",
    )
    max_live_parameters: StrictInt | None = Field(
        None,
        ge=0,
        description="elements of gathered parameters a rank holds at once before it releases "
        "some. Unset: from docs/zero3_tuning.md's table",
    )
    overlap_comm: bool | None = Field(
        None,
        description="overlap the gradients' reduce-scatter (and the gathers) with compute, at "
        "the cost of communication buffers. Unset: from docs/zero3_tuning.md's table",
    )


class LoraConfig(Section):
    """Low-rank adapters (Hu et al., LoRA, arXiv 2106.09685) trained with PEFT in place of the
    full model: W + (alpha / rank) * B A on each targeted linear layer, B starting at zero."""

    rank: StrictInt = Field(
        16,
        ge=1,
        le=512,
        description="r, the adapters' rank (at most 512, the largest vLLM serves); the "
        "engines' LoRA slot is sized to the next rank vLLM supports (1, 8, 16, 32, 64, 128, "
        "256, 320, 512)",
    )
    alpha: FloatSetting = Field(
        32.0,
        gt=0,
        le=1024,
        description="the update is scaled by alpha / rank (PEFT's lora_alpha; at most 1024, "
        "twice the largest rank)",
    )
    dropout: FloatSetting = Field(
        0.0,
        ge=0,
        lt=1,
        description="dropout on the adapters' input while training (PEFT's lora_dropout); "
        "the engines sample without it, so keep it 0 for on-policy log-probs",
    )
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description="the linear layers that get adapters: module names or name suffixes "
        "(q_proj, v_proj, ...), or all-linear (every linear layer of the transformer blocks, "
        "PEFT's meaning); vLLM serves adapters on the blocks' projections only, so the "
        "embedding and the output head cannot be targets",
    )

    @field_validator("target_modules")
    @classmethod
    def _some_modules(cls, modules):
        if isinstance(modules, list) and not modules:
            raise ValueError("names no module (use all-linear or list module names)")
        if isinstance(modules, list) and any(not m.strip() for m in modules):
            raise ValueError("an empty module name")
        return modules


class LearnerConfig(Section):
    """Learning: the DeepSpeed ZeRO-3 ranks, their optimizer and micro-batches."""

    num_ranks: StrictInt = Field(
        2, ge=1, description="DeepSpeed ranks (Ray actors), each holding a ZeRO-3 shard"
    )
    zero_stage: Literal[3] = Field(
        3, description="DeepSpeed ZeRO stage; 3 only (parameters, gradients and optimizer sharded)"
    )
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    micro_batch_tokens: StrictInt = Field(
        16384,
        ge=1,
        description="positions of one micro-batch, padding included (rows x longest row, "
        "after packing with pack_sequences); "
        "activation memory grows with it (with gradient_checkpointing, a layer's input per "
        "position and one layer's activations). Each micro-batch gathers every ZeRO-3 "
        "parameter in its forward and again in its backward, so fewer, larger ones cost less. "
        "A longer sequence gets a micro-batch of its own",
    )
    mini_batches_per_step: StrictInt = Field(1, ge=1, description="optimizer updates per step")
    pack_sequences: bool = Field(
        True,
        description="padding-free micro-batches: several sequences share a row as wide as the "
        "micro-batch's longest, each kept to itself by position_ids that restart at 0 "
        "(transformers' packed-sequence attention: varlen flash attention on GPUs, a "
        "block-causal mask otherwise), so a micro-batch computes about its real tokens instead "
        "of rows x longest row. Checked at start: a model whose attention ignores it is refused",
    )
    gradient_checkpointing: bool = Field(
        True,
        description="recompute each transformer layer's activations in backward instead of "
        "keeping them: saves most activation memory, costs about one more forward per update",
    )
    offload_optimizer: bool = Field(
        False,
        description="ZeRO-3: keep the fp32 master weights, gradients and Adam moments in CPU "
        "memory and take the optimizer step there; frees about 16 bytes per parameter (shared "
        "among the ranks) of accelerator memory, costs moving gradients and weights over PCIe "
        "and a CPU step per update. The step is the learner's torch AdamW (DeepSpeed's faster "
        "CPU Adam needs its compiled op, which an install with DS_BUILD_OPS=0 lacks)",
    )
    offload_params: bool = Field(
        False,
        description="ZeRO-3: keep the parameter shards in CPU memory and fetch each layer's "
        "weights to the accelerator in every forward and backward; frees the shards' memory, "
        "costs that transfer on every pass",
    )
    zero3: Zero3Config = Field(default_factory=Zero3Config)
    lora: LoraConfig | None = Field(
        None,
        description="off (null) by default; {rank, alpha, dropout, target_modules}: train LoRA "
        "adapters on the frozen model (no gradients or optimizer state for its weights), sync "
        "only the adapters to the engines, which serve them with vLLM's LoRA; a KL reference "
        "is the model with the adapters off (docs/lora.md)",
    )
    resources: LearnerRankResources = Field(default_factory=LearnerRankResources)


class ClipConfig(Section):
    """PPO's clipping of the probability ratio."""

    eps_low: FloatSetting = Field(
        0.2,
        ge=0,
        le=1,
        description="PPO clip below: the ratio r = pi/pi_old is held at >= 1 - eps_low for A < 0 "
        "(Schulman et al., PPO, arXiv 1707.06347)",
    )
    eps_high: FloatSetting = Field(
        0.28,
        ge=0,
        description="PPO clip above: r is held at <= 1 + eps_high for A > 0; 0.28 > eps_low is "
        "DAPO's clip-higher, which keeps low-probability tokens able to rise (arXiv 2503.14476)",
    )
    dual_clip: FloatSetting | None = Field(
        None,
        gt=1,
        description="dual clip c: for A < 0 the token loss is capped at -c A, so a huge ratio "
        "cannot blow up a negative sample (Ye et al., arXiv 1912.09729); unset = off",
    )


class KLConfig(Section):
    """A KL penalty to the initial policy."""

    coef: FloatSetting = Field(
        0.0,
        ge=0,
        le=10,
        description="beta of a KL penalty to the frozen initial policy, added per token (GRPO, "
        "arXiv 2402.03300); 0 = off and no reference model is loaded",
    )
    estimator: Literal["k1", "k2", "k3"] = Field(
        "k3",
        description="per-token KL estimator: k1 = logp - ref, k2 = (logp - ref)^2 / 2, "
        "k3 = exp(ref - logp) - (ref - logp) - 1 (Schulman, 'Approximating KL Divergence', 2020)",
    )


class StapoConfig(Section):
    """STAPO: silencing spurious tokens."""

    enabled: bool = Field(
        False,
        description="STAPO: silence spurious tokens (low probability, low entropy, in positive "
        "responses) and renormalise (arXiv 2602.15620); its would-be share is always measured",
    )
    tau_p: FloatSetting | Literal["auto"] = Field(
        0.002,
        description="STAPO probability threshold: candidates have p < tau_p (arXiv 2602.15620); "
        "'auto' sets it each mini-batch so that target_share of the running distribution of "
        "the probabilities STAPO examines (tokens of positive-advantage responses) is below it",
    )
    target_share: FloatSetting = Field(
        0.01,
        gt=0,
        lt=1,
        description="with tau_p: auto, the share of examined tokens to put below the threshold",
    )
    auto_decay: FloatSetting = Field(
        0.8,
        ge=0,
        lt=1,
        description="with tau_p: auto, how much of the running distribution each mini-batch "
        "keeps before adding its own tokens (0 = this mini-batch's alone)",
    )

    @field_validator("tau_p", mode="before")
    @classmethod
    def _tau_p_probability_or_auto(cls, tau_p: object) -> object:
        if tau_p == "auto":
            return tau_p
        if isinstance(tau_p, bool) or not isinstance(tau_p, int | float) or not 0 < tau_p <= 1:
            raise ValueError("must be a probability in (0, 1] or 'auto'")
        return tau_p

    quantile: FloatSetting = Field(
        0.75,
        ge=0,
        le=1,
        description="STAPO entropy quantile q: candidates with entropy below the q-quantile of "
        "the candidates' entropies are silenced (arXiv 2602.15620)",
    )
    prob_source: Literal["current", "old"] = Field(
        "current",
        description="whose p and entropy select STAPO's tokens: the current policy inside the "
        "mini-batch loop (the paper's choice) or the proximal policy (the learner's at the "
        "step's start)",
    )


class ARConfig(Section):
    """Advantage Reweighting of low-probability tokens."""

    alpha: FloatSetting = Field(
        0.0,
        ge=0,
        le=1,
        description="Advantage Reweighting: A <- (alpha p_old + 1 - alpha) A damps the "
        "low-probability tokens that dominate updates (Yang et al., arXiv 2505.12929; 0.3 for "
        "logic puzzles, 0.1 for math); 0 = off",
    )


class LoptiConfig(Section):
    """Lopti: low-probability tokens updated in a pass of their own."""

    enabled: bool = Field(
        False,
        description="Lopti: two optimizer passes per mini-batch, tokens with p_old < eta first, "
        "then the rest (Yang et al., arXiv 2505.12929)",
    )
    eta: FloatSetting = Field(
        0.5,
        ge=-1,
        le=1,
        description="Lopti probability threshold; eta < 0 updates the high-probability tokens "
        "first (arXiv 2505.12929)",
    )


class EntropyMaskConfig(Section):
    """Training only the highest-entropy tokens."""

    enabled: bool = Field(
        False,
        description="train only the highest-entropy tokens ('forking tokens'); the denominator "
        "keeps every valid token (Wang et al., 'Beyond the 80/20 Rule', arXiv 2506.01939)",
    )
    rho: FloatSetting = Field(
        0.2,
        gt=0,
        le=1,
        description="share of tokens kept, by entropy over the mini-batch (arXiv 2506.01939)",
    )


class DFPOConfig(Section):
    """DFPO's exchangeable group weights."""

    weight_transform: Literal["min_replace", "adv_orthogonal"] = Field(
        "min_replace",
        description="how dfpo makes the sequence weights of a group exchangeable so shared tokens "
        "cancel: the group's minimum weight, or the weights' component orthogonal to the "
        "advantages (arXiv 2604.13088)",
    )


class OffPolicyConfig(Section):
    """The off-policy correction of stale samples (decoupled PPO)."""

    mode: Literal["none", "tis", "mis"] = Field(
        "none",
        description="off-policy correction of decoupled PPO (Hilton et al., arXiv 2110.00641): "
        "each token's policy loss is weighted by w = pi_proximal / pi_behaviour, the learner's "
        "recomputed log-probs over vLLM's sampled ones. none: w = 1; tis: truncated, min(w, "
        "cap) (Yao et al., 'Your Efficient RL Framework Secretly Brings You Off-Policy RL "
        "Training', 2025); mis: masked, w inside the band and 0 outside (IcePop, arXiv "
        "2510.18855). Unset = tis when trainer.max_staleness > 0, else none",
    )
    level: Literal["token", "sequence"] = Field(
        "token",
        description="token: one w per token; sequence: one w per response, the product of its "
        "tokens' ratios, truncated or masked as a whole",
    )
    cap: FloatSetting = Field(
        2.0,
        ge=1,
        le=100,
        description="tis: the largest weight (>= 1, so an on-policy weight of 1 stays 1)",
    )
    band: tuple[FloatSetting, FloatSetting] = Field(
        (0.5, 2.0),
        description="mis: [low, high] of the weights kept, low <= 1 <= high; a token (or "
        "response) outside it gets weight 0 and stays in the aggregation's denominator",
    )

    @model_validator(mode="after")
    def _check_band(self) -> OffPolicyConfig:
        low, high = self.band
        if not 0 <= low <= 1 <= high:
            raise ValueError(f"band {list(self.band)}: must satisfy 0 <= low <= 1 <= high")
        return self


EXCHANGEABLE_AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "constant")


class AlgorithmConfig(Section):
    """The RL method: preset, advantages, loss, aggregation and token-credit transforms."""

    preset: str = Field(
        "grpo",
        description="named method (groupflow/presets.py): its keys are the defaults of this "
        "section, and any key set here overrides them",
    )
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_baseline"] = Field(
        "grpo",
        description="advantage estimator per group: grpo (R - mean) / std (DeepSeekMath, arXiv "
        "2402.03300); dr_grpo R - mean (arXiv 2503.20783); rloo R - leave-one-out mean (Ahmadian "
        "et al., arXiv 2402.14740); reinforce_baseline R - mean, whitened over the batch's tokens",
    )
    std: Literal["unbiased", "biased", "none"] = Field(
        "unbiased", description="the group standard deviation that grpo divides by"
    )
    loss: Literal["ppo", "gspo", "linear", "dfpo"] = Field(
        "ppo",
        description="per-token policy loss: ppo clipped surrogate (arXiv 1707.06347); gspo "
        "sequence-level ratio and clip (arXiv 2507.18071); linear clip-free -A logp (REINFORCE); "
        "dfpo linear with exchangeable group weights (arXiv 2604.13088)",
    )
    aggregation: Literal["token_mean", "seq_mean_token_sum", "constant", "seq_mean_token_mean"] = (
        Field(
            "token_mean",
            description="how token losses are summed into the step's loss; token_mean, "
            "seq_mean_token_sum and constant (Dr. GRPO, arXiv 2503.20783) give every response "
            "of a group the same coefficient, so tokens shared by good and bad responses cancel; "
            "seq_mean_token_mean (original GRPO) breaks that with unequal lengths (arXiv "
            "2604.13088)",
        )
    )
    clip: ClipConfig = Field(default_factory=ClipConfig)
    kl: KLConfig = Field(default_factory=KLConfig)
    entropy_coef: FloatSetting = Field(
        0.0,
        ge=-1,
        le=1,
        description="weight of an entropy bonus subtracted from the loss (Williams and Peng, "
        "1991); 0 = off",
    )
    dynamic_sampling: bool = Field(
        False,
        description="drop groups whose rewards are all equal (they carry no gradient) and draw "
        "more prompts (DAPO, arXiv 2503.14476)",
    )
    stapo: StapoConfig = Field(default_factory=StapoConfig)
    ar: ARConfig = Field(default_factory=ARConfig)
    lopti: LoptiConfig = Field(default_factory=LoptiConfig)
    entropy_mask: EntropyMaskConfig = Field(default_factory=EntropyMaskConfig)
    dfpo: DFPOConfig = Field(default_factory=DFPOConfig)
    off_policy: OffPolicyConfig = Field(default_factory=OffPolicyConfig)
    lowprob_eta: FloatSetting = Field(
        0.5,
        gt=0,
        le=1,
        description="p threshold of the lowprob_frac and lowprob_grad_share diagnostics "
        "(arXiv 2505.12929)",
    )
    mask_truncated: bool = Field(
        False,
        description="train nothing on responses cut at rollout.sampling.max_tokens (DAPO's "
        "overlong filtering, arXiv 2503.14476): they still count in their group's baseline",
    )
    cancellation_diagnostic: bool = Field(
        True,
        description="measure cancellation_residual: how far the gradient on tokens shared "
        "within a group fails to cancel (arXiv 2604.13088); costs a per-token gradient capture",
    )

    @model_validator(mode="after")
    def _check(self) -> AlgorithmConfig:
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {sorted(PRESETS)}")
        if self.loss == "dfpo" and self.aggregation not in EXCHANGEABLE_AGGREGATIONS:
            raise ValueError(
                f"loss 'dfpo' relies on token gradient cancellation, which aggregation "
                f"{self.aggregation!r} breaks; use one of {list(EXCHANGEABLE_AGGREGATIONS)}"
            )
        return self


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
    seed: StrictInt = Field(0, description="seed of the learner and of the prompt order")
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


class ClusterConfig(Section):
    """The Ray cluster the job runs on."""

    address: str | None = Field(
        None,
        description="Ray address of a cluster to drive the job from this process, in any form "
        "of docs/jobs.md's address rule (e.g. auto, HOST:6379, http://HEAD:8265) but ray:// "
        "(Ray Client: use groupflow submit); unset = $RAY_ADDRESS, else a local cluster",
    )
    num_cpus: FloatSetting | None = Field(
        None, gt=0, description="CPUs of a local cluster; unset = detected"
    )
    placement_timeout_s: FloatSetting = Field(
        300.0,
        gt=0,
        le=86_400,
        allow_inf_nan=False,
        description="seconds every actor the job starts with may wait for a node before the "
        "job fails, naming the pool that was not placed (raise it where an autoscaler adds "
        "nodes slowly)",
    )

    @field_validator("address")
    @classmethod
    def _not_ray_client(cls, address: str | None) -> str | None:
        refusal = ray_client_refusal(address)
        if refusal is not None:
            raise ValueError(refusal)
        return address


def ray_client_refusal(address: str | None) -> str | None:
    """Why a job cannot be driven from `address`, when it is a Ray Client one (ray://): the
    weights reach the engines through streaming actor methods, which Ray Client does not
    carry, so such a job would train up to its first weight sync and then crash."""
    if address is None or not address.strip().lower().startswith("ray://"):
        return None
    return (
        f"{address} is a Ray Client address, and a job cannot be driven through Ray Client "
        "(its streaming actor methods, which carry the weights to the engines, are not "
        "supported there); run it on the cluster with `groupflow submit --address "
        "http://HEAD:8265`"
    )


class Config(Section):
    """A groupflow job."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)

    def agent_tools(self) -> list[str]:
        """The job's tools: agent.tools, or where unset the task's own (`TOOLS`)."""
        if self.agent.tools is not None:
            return self.agent.tools
        from groupflow.reward_workers.tasks import task_class

        return list(getattr(task_class(self.task.name), "TOOLS", ()))

    @property
    def multi_turn(self) -> bool:
        return bool(self.agent_tools()) or self.agent.environment is not None

    @model_validator(mode="after")
    def _check(self) -> Config:
        if self.learner.mini_batches_per_step > self.rollout.prompts_per_step:
            raise ValueError(
                "learner.mini_batches_per_step: "
                f"{self.learner.mini_batches_per_step} mini-batches cannot be cut from "
                f"rollout.prompts_per_step={self.rollout.prompts_per_step} groups"
            )
        limits = {"rollout.sampling.max_tokens": self.rollout.sampling.max_tokens}
        if self.task.name == "mixture":
            from groupflow.reward_workers.tasks.mixture import mixture_entries

            for e in mixture_entries(self.task.options["tasks"]):
                if e.max_tokens is not None:
                    limits[f"task {e.label}: max_tokens"] = e.max_tokens
        for where, limit in limits.items():
            if limit >= self.rollout.max_model_len:
                raise ValueError(
                    f"{where} ({limit}) must be below rollout.max_model_len "
                    f"({self.rollout.max_model_len})"
                )
        penalty = self.reward.overlong_penalty
        for where, limit in limits.items():
            if penalty is not None and penalty.buffer_tokens >= limit:
                raise ValueError(
                    f"reward.overlong_penalty.buffer_tokens ({penalty.buffer_tokens}) must be "
                    f"below {where} ({limit})"
                )
        if self.rollout.partial_rollout is None:
            self.rollout.partial_rollout = self.trainer.max_staleness > 0
        off_policy = self.algorithm.off_policy
        if "mode" not in off_policy.model_fields_set and self.trainer.max_staleness > 0:
            # Stale samples come from a policy the learner no longer holds: correct by default.
            off_policy.mode = "tis"
        return self

    def dump_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


class _YAMLBoundError(yaml.YAMLError):
    """A YAML document past one of the bounds above."""

    def __init__(self, problem: str, mark: yaml.Mark | None):
        where = f" (line {mark.line + 1})" if mark is not None else ""
        super().__init__(f"{problem}{where}")


class _BoundedLoader(yaml.SafeLoader):
    """YAML's safe loader, with the depth of nesting, the size after alias expansion and the
    digits of an integer bounded, and a recursive alias refused: a hostile document fails
    while it is read, before it can exhaust memory or recursion."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0
        self._expanded: dict[int, int] = {}  # id(node) -> nodes it stands for, aliases expanded

    def fetch_flow_collection_start(self, token_class):
        # Refused while scanning: the scanner's work on each `[` or `{` grows with the depth.
        if self.flow_level >= MAX_YAML_DEPTH:
            raise _YAMLBoundError(f"nested deeper than {MAX_YAML_DEPTH} levels", self.get_mark())
        super().fetch_flow_collection_start(token_class)

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            node = self.anchors.get(event.anchor)
            if node is not None and id(node) not in self._expanded:
                raise _YAMLBoundError(
                    f"alias *{event.anchor} refers to a node that contains it", event.start_mark
                )
            return super().compose_node(parent, index)  # counted when its anchor was
        self._depth += 1
        if self._depth > MAX_YAML_DEPTH:
            raise _YAMLBoundError(f"nested deeper than {MAX_YAML_DEPTH} levels", event.start_mark)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        self._count(node)
        return node

    def _count(self, node: yaml.Node) -> None:
        children = []
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        size = 1 + sum(self._expanded[id(child)] for child in children)
        if size > MAX_YAML_NODES:
            raise _YAMLBoundError(
                f"expands to more than {MAX_YAML_NODES} values (aliases counted in full)",
                node.start_mark,
            )
        self._expanded[id(node)] = size

    def construct_yaml_int(self, node):
        digits = sum(c.isalnum() for c in node.value.removeprefix("0x").removeprefix("0o"))
        if digits > MAX_INT_DIGITS:
            raise _YAMLBoundError(
                f"an integer of {digits} digits (at most {MAX_INT_DIGITS})", node.start_mark
            )
        return super().construct_yaml_int(node)


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)


def parse_yaml(text: str) -> Any:
    """One YAML document, within the bounds above; yaml.YAMLError when it is not one."""
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


# YAML 1.1 reads these as booleans; on a command line they are far more often names
# (`--set trainer.run_name=off`). true/false still give booleans.
_YAML11_BOOL_WORDS = {"on", "off", "yes", "no", "y", "n"}


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (['a','b','c'], parsed value); the value is read as YAML."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r}: expected key.path=value")
    value = value.strip()
    if value.lower() in _YAML11_BOOL_WORDS:
        return key.strip().split("."), value
    try:
        parsed = parse_yaml(value) if value else None
    except yaml.YAMLError as err:
        raise ConfigError(
            f"--set {key.strip()}: the value is not valid YAML ({first_line(err)})"
        ) from None
    return key.strip().split("."), parsed


def _set_path(tree: dict, path: list[str], value: Any) -> None:
    node = tree
    for i, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(path[: i + 1])}: is a value, not a section")
        node = child
    node[path[-1]] = value


def _merge(base: dict, top: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _format_error(err: ValidationError) -> str:
    first = err.errors()[0]
    key = ".".join(str(p) for p in first["loc"]) or "config"
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    elif "input" in first and not isinstance(first["input"], dict):
        msg += f" (got {_describe_input(first['input'])})"
    return f"{key}: {msg}"


def _describe_input(value: Any) -> str:
    if isinstance(value, int) and value.bit_length() > 128:  # repr() refuses the longest
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 100 else text[:100] + "..."


def _task_list_as_mixture(tree: dict) -> dict:
    """`task: [{name: math, weight: 3}, ...]` is short for the built-in task `mixture` with
    that list as its options (several tasks in one job, reward_workers/tasks/mixture.py)."""
    if isinstance(tree.get("task"), list):
        tree["task"] = {"name": "mixture", "options": {"tasks": tree["task"]}}
    return tree


def build_config(raw: dict | None = None, overrides: list[str] = ()) -> Config:
    """Validate a raw dict plus `--set` overrides; the algorithm preset fills in defaults."""
    tree = _task_list_as_mixture(copy.deepcopy(raw or {}))
    for text in overrides:
        path, value = parse_override(text)
        _set_path(tree, path, value)
        _task_list_as_mixture(tree)  # `--set task=[...]` then `--set task.eval_size=...`
    algorithm = tree.get("algorithm", {})
    if isinstance(algorithm, dict):
        preset = algorithm.get("preset", AlgorithmConfig.model_fields["preset"].default)
        if isinstance(preset, str) and preset in PRESETS:
            tree["algorithm"] = _merge(PRESETS[preset], algorithm)
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None
    check_task_options(cfg.task)
    return cfg


def task_option_sets(task: TaskConfig) -> list[tuple[str, dict[str, Any], str]]:
    """(task name, its options, where they are in the config) for the job's task (each of a
    mixture's tasks) and each held-out set; the options are the config's own dicts."""
    if task.name == "mixture":
        from groupflow.reward_workers.tasks.mixture import mixture_entries

        # Named as written: `task: [{name: math, options: {...}}, ...]`
        entries = mixture_entries(task.options["tasks"])
        named = [(e.name, e.options, f"task[{i}].options") for i, e in enumerate(entries)]
    else:
        named = [(task.name, task.options, "task.options")]
    for i, held_out in enumerate(task.eval_sets):
        named.append((held_out.task, held_out.options, f"task.eval_sets[{i}].options"))
    return named


def check_task_options(task: TaskConfig) -> None:
    """Each task's options (a mixture's, each of its tasks'; each held-out set's) against the
    options that task declares: a misspelt or ill-typed one is a ConfigError naming its key,
    here rather than when the task is built on the cluster."""
    from groupflow.reward_workers.tasks import check_options

    try:
        for name, options, where in task_option_sets(task):
            check_options(name, options, where)
    except ValueError as err:
        raise ConfigError(str(err)) from None


QUICKSTART = Path(__file__).with_name("quickstart.yaml")


def _read_config_text(path: Path) -> str:
    """The file's text, at most MAX_CONFIG_BYTES of UTF-8."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the config ({err.strerror})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES >> 20} MiB, not a config")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start})") from None


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Load a YAML config (None = the built-in quickstart job) and apply overrides."""
    path = Path(path) if path is not None else QUICKSTART
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        raw = parse_yaml(_read_config_text(path)) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({first_line(err)})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return build_config(_named_after_file(raw, path), overrides)


def _named_after_file(raw: dict, path: Path) -> dict:
    """A file that leaves trainer.run_name unset names its run after itself (job.yaml: job),
    so that two users' jobs, or a job and the quickstart, never share a run directory or
    resume each other's checkpoints."""
    trainer = raw.get("trainer", {})
    if not isinstance(trainer, dict) or "run_name" in trainer:
        return raw  # a malformed section is the schema's to refuse
    name = path.stem.lstrip(".") or TrainerConfig.model_fields["run_name"].default
    return {**raw, "trainer": {**trainer, "run_name": name}}


def small_model_config(raw: dict | None = None, overrides: list[str] = ()) -> Config:
    """A job from the schema's defaults with quickstart.yaml's engine limits
    (rollout.max_model_len and rollout.sampling.max_tokens) beneath `raw`: the defaults fit a
    real model's context, past the 256 positions of the built-in small model, which the tests
    and benchmarks that start engines on it build their jobs on."""
    rollout = parse_yaml(_read_config_text(QUICKSTART))["rollout"]
    limits = {
        "rollout": {
            "max_model_len": rollout["max_model_len"],
            "sampling": {"max_tokens": rollout["sampling"]["max_tokens"]},
        }
    }
    return build_config(_merge(limits, _task_list_as_mixture(copy.deepcopy(raw or {}))), overrides)
