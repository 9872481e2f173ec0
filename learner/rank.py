"""One learner rank: its DeepSpeed ZeRO-3 models, its share of each step, weight export.

No Ray in here; actors/learner.py wraps it. Every public method is collective: all ranks call
it together, each with its own share of the step (see learner/batching.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from groupflow.config.job import Config
from groupflow.core.records import TrainSequence
from groupflow.core.sync_probe import ProbeLogprobs, job_probe
from groupflow.core.weight_format import Broadcaster, Checksums, Manifest
from groupflow.learner.batching import pack_rows
from groupflow.learner.checkpoint import load_rank_checkpoint, save_rank_checkpoint, saving_to
from groupflow.learner.distributed import DistributedReducer
from groupflow.learner.figures import RankFigures
from groupflow.learner.host_memory import (
    map_large_blocks,
    peak_resident_bytes,
    release_freed_memory,
    reset_peak,
    resident_bytes,
)
from groupflow.learner.memory_budget import (
    ModelShape,
    bytes_per_position,
    choose_checkpointing,
    estimated_budget,
    fixed_bytes,
    measured_budget,
    mini_batch_share,
    rank_memory_bytes,
)
from groupflow.learner.micro_batch import check_packing
from groupflow.learner.moe_aux import MoeRouting
from groupflow.learner.probe import probe_logprobs
from groupflow.learner.routing_replay import check_routing, routing_state
from groupflow.learner.sequence_parallel import install_ulysses, parallel_groups
from groupflow.learner.step import MicroBatches, StepSettings
from groupflow.learner.step import train_step as train_rank_step
from groupflow.learner.weight_export import (
    broadcast_weights,
    save_pretrained,
    shard_buckets,
    weight_manifest,
)
from groupflow.learner.zero_config import model_parameter_count
from groupflow.learner.zero_models import RankSetup, build_zero_models


class LearnerRank:
    def __init__(self, setup: RankSetup, cfg: Config):
        self.setup = setup
        if setup.device.kind == "cpu":
            map_large_blocks()  # before the models: every large block of the rank's mapped
        baseline = resident_bytes()  # the process before its models
        self.memory = self._rank_memory(cfg)
        cfg = self._decide_checkpointing(cfg, baseline)
        self.models = build_zero_models(setup, cfg)
        policy = self.models.policy
        groups = parallel_groups(setup.world_size, setup.rank, cfg.learner.sequence_parallel_size)
        self.sequence_parallel = groups.sequence
        if groups.sequence is not None:
            install_ulysses(self._module, groups.sequence)
            reference = getattr(self.models.reference, "module", None)  # LoRA's shares the policy's
            if reference is not None:
                install_ulysses(reference, groups.sequence)
        self.settings = StepSettings.of(
            algorithm=cfg.algorithm,
            temperature=cfg.rollout.sampling.temperature,
            reducer=DistributedReducer(groups.data_size, policy.device, groups.data_group),
            packed=cfg.learner.pack_sequences,
            sequence_parallel=groups.sequence,
        )
        self.settings.moe = MoeRouting.of(self._module, cfg.learner.moe.aux_loss_coef)
        if cfg.learner.pack_sequences:
            vocab_size = self._module.config.vocab_size
            check_packing(policy.model, vocab_size, policy.device, groups.sequence)
        self.sent_checksums: Checksums = {}  # this rank's shares of the last sync's checksums
        self.sync_probe = job_probe(setup.model_path, cfg.trainer.seed, cfg.rollout.max_model_len)
        self._probe_logprobs: ProbeLogprobs | None = None  # at the current weights, once taken
        self.lora = cfg.learner.lora is not None
        self.save_merged = cfg.trainer.save_merged
        self._plan_memory(cfg, baseline)

    def _rank_memory(self, cfg: Config) -> int:
        """The bytes this rank may use (learner.memory_gib, or its share of the device or node)."""
        device_bytes = 0
        if self.setup.device.kind == "cuda":
            device = self.setup.device.torch_device()
            device_bytes = torch.cuda.get_device_properties(device).total_memory
        node_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return rank_memory_bytes(
            cfg.learner.memory_gib, node_bytes, device_bytes, self.setup.world_size
        )

    def _decide_checkpointing(self, cfg: Config, baseline: int) -> Config:
        """The job's config with `learner.gradient_checkpointing: auto` decided for this rank
        (learner/memory_budget.py) from the model's config, before any model is built;
        `checkpointing` keeps the choice and `checkpointing_line` says it."""
        setting = cfg.learner.gradient_checkpointing
        if setting != "auto":
            self.checkpointing = setting
            self.checkpointing_line = f"gradient checkpointing {'on' if setting else 'off'}"
            return cfg
        from transformers import AutoConfig

        path = self.setup.model_path
        shape = ModelShape.of(AutoConfig.from_pretrained(path), model_parameter_count(path))
        dtype_bytes = _dtype_bytes(cfg)
        share = mini_batch_share(
            cfg.rollout.prompts_per_step * cfg.rollout.group_size,
            self.setup.world_size,
            cfg.learner.mini_batches_per_step,
            cfg.rollout.max_model_len,
            cfg.learner.sequence_parallel_size,
        )
        fixed = fixed_bytes(shape, dtype_bytes, self.setup.world_size, baseline)
        choice = choose_checkpointing(self.memory, fixed, shape, dtype_bytes, share)
        self.checkpointing, self.checkpointing_line = choice.on, choice.line()
        learner = cfg.learner.model_copy(update={"gradient_checkpointing": choice.on})
        return cfg.model_copy(update={"learner": learner})

    def _plan_memory(self, cfg: Config, baseline: int) -> None:
        """The micro-batch budget of `learner.micro_batch_tokens: auto` (learner/memory_budget.py)
        from the model's config; `micro_batch_tokens` answers it, and the first step's
        measurement replaces it."""
        dtype_bytes = _dtype_bytes(cfg)
        # from the partitioned model itself: building one from the config here, with ZeRO-3's
        # HfDeepSpeedConfig alive, would partition its meta tensors
        parameters = sum(getattr(p, "ds_numel", p.numel()) for p in self._module.parameters())
        shape = ModelShape.of(self._module.config, parameters)
        per_position = bytes_per_position(shape, dtype_bytes, self.checkpointing)
        fixed = fixed_bytes(shape, dtype_bytes, self.setup.world_size, baseline)
        self.budget = estimated_budget(self.memory, fixed, per_position)
        self.budget_measured = False

    def micro_batch_tokens(self) -> tuple[int, bool]:
        """The positions a micro-batch may hold in this rank's memory, and whether a step
        measured it (else it is the model config's estimate)."""
        return self.budget, self.budget_measured

    def _memory_now(self) -> int:
        device = self.models.policy.device
        return torch.cuda.memory_allocated(device) if device.type == "cuda" else resident_bytes()

    @property
    def _module(self) -> torch.nn.Module:
        return self.models.policy.zero_model.module

    @property
    def _is_source(self) -> bool:
        return self.setup.rank == 0

    def train_step(self, minibatches: list[MicroBatches], lr: float | None = None) -> RankFigures:
        """minibatches[m][k] = this rank's k-th micro-batch of mini-batch m; `lr`, the step's
        learning rate (learner/lr_schedule.py; None keeps the current one)."""
        if lr is not None:
            for group in self.models.policy.zero_model.optimizer.param_groups:
                group["lr"] = lr
        self.models.policy.zero_model.train()
        cuda = self.models.policy.device.type == "cuda"
        before = self._memory_now()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            reset_peak()
        routers = routing_state(self.models.policy.model)
        if routers is not None and routers.replay:
            check_routing([s for m in minibatches for mb in m for s in mb])
        figures = train_rank_step(
            self.models.policy, self.models.reference, minibatches, self.settings
        )
        if routers is not None:
            figures.routing = routers.take_counts()
        peak = torch.cuda.max_memory_allocated() if cuda else peak_resident_bytes()
        release_freed_memory()
        figures.peak_memory_bytes, figures.memory_limit_bytes = peak, self.memory
        positions = max(
            (_positions(mb, self.settings.packed) for m in minibatches for mb in m), default=0
        )
        if not self.budget_measured and positions:
            self.budget = measured_budget(self.memory, before, peak, positions)
            self.budget_measured = True
        if self.sequence_parallel is not None and self.sequence_parallel.rank > 0:
            # The group's ranks trained the same sequences and hold the same figures: one
            # rank of the group speaks for it, or the driver's sums would count them each time.
            figures = RankFigures(
                credit=figures.credit,
                grad_norms=figures.grad_norms,
                peak_memory_bytes=peak,
                memory_limit_bytes=self.memory,
            )
        # The probe of the weights the next sync sends, taken now, while the driver waits for
        # the step anyway, so that checking the engines' loads waits for nothing.
        self._probe_logprobs = None
        self._probe_logprobs = self.probe_logprobs()
        return figures

    def probe_logprobs(self) -> ProbeLogprobs:
        """The policy's log-probs of the sync probe at its current weights: those its last
        step took, or (a learner that has not stepped since it started or loaded a
        checkpoint) taken now, on every rank (collective)."""
        if self._probe_logprobs is None:
            policy = self.models.policy
            self._probe_logprobs = probe_logprobs(
                policy.model,
                self.sync_probe,
                policy.device,
                self.settings.packed,
                self.sequence_parallel,
            )
        return self._probe_logprobs

    def weight_shard_buckets(self, buckets: list[Manifest]) -> Iterator[torch.Tensor]:
        """This rank's partition of each bucket as one flat tensor (local: no collective);
        its shares of the checksums are `sent_checksums` once the last one is out."""
        self.sent_checksums = {}
        setup = self.setup
        return shard_buckets(
            self._module, buckets, setup.rank, setup.world_size, self.sent_checksums
        )

    def weight_manifest(self) -> Manifest:
        return weight_manifest(self._module)

    def broadcast_weights(self, group: Broadcaster | None, buckets: list[Manifest]) -> None:
        """Rank 0 passes the engines' weight group, the other ranks None (they only gather)."""
        self.sent_checksums = broadcast_weights(self._module, group, buckets)

    def save_pretrained(self, path: str) -> None:
        with saving_to(path):
            save_pretrained(self._module, self._is_source, path, merged=self.save_merged)

    def save_checkpoint(self, directory: str) -> None:
        """The policy's ZeRO-3 model and optimizer shards (the frozen reference is rebuilt
        from the model path on a resume, so it is not saved; with LoRA, neither is the frozen
        base model), and STAPO's running threshold."""
        save_rank_checkpoint(
            self.models.policy.zero_model,
            directory,
            self.setup.rank,
            self.settings.auto_tau_p,
            adapters_only=self.lora,
        )

    def load_checkpoint(self, directory: str) -> str | None:
        """On a resume and on new ranks after a failure; a line for the driver's log when
        STAPO's running threshold starts afresh."""
        self._probe_logprobs = None  # other weights
        return load_rank_checkpoint(
            self.models.policy.zero_model,
            directory,
            self.setup.rank,
            self.settings.auto_tau_p,
            adapters_only=self.lora,
        )


def _dtype_bytes(cfg: Config) -> int:
    return torch.finfo(getattr(torch, cfg.model.dtype)).bits // 8


def _positions(seqs: list[TrainSequence], packed: bool) -> int:
    """The positions a micro-batch computes: rows x its longest sequence."""
    lengths = [len(s.input_ids) for s in seqs]
    if not lengths:
        return 0
    rows = pack_rows(lengths)[2] if packed else len(lengths)
    return rows * max(lengths)
