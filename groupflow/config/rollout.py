"""The `rollout` section: the vLLM engines that sample, their groups and sampling."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictInt, field_validator, model_validator

from groupflow.config.base import EngineResources, FloatSetting, Section


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
    (groupflow/loop/scaling.py: AutoscalePolicy)."""

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
    # The default is what `resolve` makes of an unset value at the default staleness (0), so
    # that the defaults are resolved already.
    partial_rollout: bool | None = Field(
        False,
        description="load a weight sync while requests run (they stop for the load and go on "
        "under the new weights, each token labelled with the version that sampled it; "
        "staleness counts from a group's oldest token) instead of letting them finish under "
        "the old weights first while new requests wait; unset (or null): on when "
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
