"""One learner rank: its DeepSpeed ZeRO-3 models, its share of each step, weight export.

No Ray in here; actors/learner.py wraps it. Every public method is collective: all ranks call
it together, each with its own share of the step (see learner/batching.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from groupflow.config.job import Config
from groupflow.core.weight_format import Broadcaster, Checksums, Manifest
from groupflow.learner.checkpoint import load_rank_checkpoint, save_rank_checkpoint, saving_to
from groupflow.learner.distributed import DistributedReducer
from groupflow.learner.figures import RankFigures
from groupflow.learner.micro_batch import check_packing
from groupflow.learner.sequence_parallel import install_ulysses, parallel_groups
from groupflow.learner.step import MicroBatches, StepSettings
from groupflow.learner.step import train_step as train_rank_step
from groupflow.learner.weight_export import (
    broadcast_weights,
    save_pretrained,
    shard_buckets,
    weight_manifest,
)
from groupflow.learner.zero_models import RankSetup, build_zero_models


class LearnerRank:
    def __init__(self, setup: RankSetup, cfg: Config):
        self.setup = setup
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
        if cfg.learner.pack_sequences:
            vocab_size = self._module.config.vocab_size
            check_packing(policy.model, vocab_size, policy.device, groups.sequence)
        self.sent_checksums: Checksums = {}  # this rank's shares of the last sync's checksums
        self.lora = cfg.learner.lora is not None
        self.save_merged = cfg.trainer.save_merged

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
        figures = train_rank_step(
            self.models.policy, self.models.reference, minibatches, self.settings
        )
        if self.sequence_parallel is not None and self.sequence_parallel.rank > 0:
            # The group's ranks trained the same sequences and hold the same figures: one
            # rank of the group speaks for it, or the driver's sums would count them each time.
            return RankFigures(credit=figures.credit, grad_norms=figures.grad_norms)
        return figures

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
        return load_rank_checkpoint(
            self.models.policy.zero_model,
            directory,
            self.setup.rank,
            self.settings.auto_tau_p,
            adapters_only=self.lora,
        )
