"""The `learner` section: the DeepSpeed ZeRO-3 ranks, their optimizer, ZeRO-3's knobs and LoRA."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StrictBool, StrictInt, field_validator, model_validator

from groupflow.config.base import FloatSetting, LearnerRankResources, Section


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


MIN_RANK_MEMORY_GIB = 0.25


class MoeConfig(Section):
    """Mixture-of-experts models on the learner (docs/moe.md); no effect on a dense model."""

    leaf_modules: bool = Field(
        True,
        description="each mixture-of-experts block (the module that holds a layer's router "
        "and experts) a ZeRO-3 leaf module (deepspeed's set_z3_leaf_modules): its parameters "
        "are gathered at once when the block runs, instead of by a hook on each of its "
        "children, whose order changes with the routing",
    )
    aux_loss_coef: FloatSetting = Field(
        0.0,
        ge=0,
        le=1,
        description="weight of the load-balancing auxiliary loss (Switch Transformer's, per "
        "layer: experts x sum over experts of the share of top-k assignments times the mean "
        "router probability, averaged over the layers) on the trained tokens, summed over "
        "them and divided by the policy loss's global token count; 0 (the default) is off. "
        "Qwen3-MoE's configs use 0.001 (router_aux_loss_coef). A dense model is refused",
    )
    routing_replay: Literal["off", "rollout", "observe"] = Field(
        "off",
        description="rollout routing replay (R3): 'rollout' routes each token through the "
        "experts the engine chose for it, in the policy, proximal and reference forwards, "
        "with gate weights from the learner's own router logits (a Qwen3-MoE-style top-k "
        "router only; refused for a dense model); 'observe': the learner's own routing, "
        "compared with the engine's (routing_disagreement; the engines return routing as "
        "with 'rollout'); 'off': the learner's own routing, the engines return none",
    )


class LearnerConfig(Section):
    """Learning: the DeepSpeed ZeRO-3 ranks, their optimizer and micro-batches."""

    num_ranks: StrictInt = Field(
        2, ge=1, description="DeepSpeed ranks (Ray actors), each holding a ZeRO-3 shard"
    )
    zero_stage: Literal[3] = Field(
        3, description="DeepSpeed ZeRO stage; 3 only (parameters, gradients and optimizer sharded)"
    )
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    micro_batch_tokens: StrictInt | Literal["auto"] = Field(
        "auto",
        description="positions of one micro-batch, padding included (rows x longest row, "
        "after packing with pack_sequences); activation memory grows with it (with "
        "gradient_checkpointing, a layer's input per position and one layer's activations). "
        "Each micro-batch gathers every ZeRO-3 parameter in its forward and again in its "
        "backward, so fewer, larger ones cost less. auto: as many as learner.memory_gib holds, "
        "from the model's bytes per position (its config, dtype and checkpointing), corrected "
        "by what the first step measured; a job whose longest sequence (rollout.max_model_len) "
        "cannot fit is refused at start. A number: that many, and a longer sequence gets a "
        "micro-batch of its own. Per rank: with sequence_parallel_size P a row counts at its "
        "share, ceil(width / P) positions",
    )
    memory_gib: FloatSetting | None = Field(
        None,
        # a rank's interpreter, torch and DeepSpeed hold more before any model: less is a
        # typo (a budget of no position, a memory alert that never clears)
        ge=MIN_RANK_MEMORY_GIB,
        le=1 << 20,
        description="memory each rank may use, in GiB, with micro_batch_tokens: auto. Unset: "
        "on a GPU, 90% of its device's memory; on a CPU node, half of the node's memory "
        f"shared among the ranks (engines, reward workers and the driver keep the other half). "
        f"At least {MIN_RANK_MEMORY_GIB}",
    )
    mini_batches_per_step: StrictInt = Field(1, ge=1, description="optimizer updates per step")
    sequence_parallel_size: StrictInt = Field(
        1,
        ge=1,
        description="ranks that share each sequence (Ulysses sequence parallelism, "
        "docs/long_sequences.md): every row of a micro-batch is cut into this many shards of "
        "consecutive positions, one per rank of a group, and attention exchanges heads for "
        "positions by all-to-all; data parallel over the groups (num_ranks / this), ZeRO-3 "
        "over all ranks. Must divide num_ranks and the model's attention heads. "
        "micro_batch_tokens counts a sharded row at its share",
    )

    @field_validator("micro_batch_tokens")
    @classmethod
    def _some_positions(cls, tokens):
        if tokens != "auto" and tokens < 1:
            raise ValueError("must be auto or at least 1")
        return tokens

    pack_sequences: bool = Field(
        True,
        description="padding-free micro-batches: several sequences share a row as wide as the "
        "micro-batch's longest, each kept to itself by position_ids that restart at 0 "
        "(transformers' packed-sequence attention: varlen flash attention on GPUs, a "
        "block-causal mask otherwise), so a micro-batch computes about its real tokens instead "
        "of rows x longest row. Checked at start: a model whose attention ignores it is refused",
    )
    gradient_checkpointing: StrictBool | Literal["auto"] = Field(
        "auto",
        description="recompute each transformer layer's activations in backward instead of "
        "keeping them: saves most activation memory, costs about one more forward per update. "
        "auto: on unless a rank's share of a mini-batch (prompts_per_step x group_size "
        "sequences of rollout.max_model_len, over the data-parallel ranks) fits one "
        "micro-batch without it in the memory the rank may use (memory_gib), as the model's "
        "config estimates; the driver's log says which, and why",
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
    moe: MoeConfig = Field(default_factory=MoeConfig)
    resources: LearnerRankResources = Field(default_factory=LearnerRankResources)

    @model_validator(mode="after")
    def _sequence_groups(self):
        if self.num_ranks % self.sequence_parallel_size:
            raise ValueError(
                f"sequence_parallel_size={self.sequence_parallel_size} does not divide "
                f"num_ranks={self.num_ranks}"
            )
        if self.moe.aux_loss_coef > 0 and self.sequence_parallel_size > 1:
            raise ValueError(
                "moe.aux_loss_coef > 0 with sequence_parallel_size > 1: the load-balancing "
                "loss needs each sequence's routing on one rank; set one of them off"
            )
        return self
