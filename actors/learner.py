"""Learner-rank actors (one DeepSpeed ZeRO-3 rank each) and the group that drives them together."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from groupflow.actors.affinity import pin_to_cores
from groupflow.actors.futures import RayFutures
from groupflow.actors.placement import live_nodes
from groupflow.actors.starting import wait_started
from groupflow.actors.transport import SyncHost
from groupflow.config import Config
from groupflow.config.base import ConfigError
from groupflow.core.device import device_for
from groupflow.core.placement import NOTE_AFTER_S, describe_cluster, describe_demand
from groupflow.core.records import TrainSequence
from groupflow.core.threads import thread_env
from groupflow.learner.batching import layout_step
from groupflow.learner.figures import RankFigures
from groupflow.learner.host_memory import allocator_env
from groupflow.learner.memory_budget import check_longest_fits
from groupflow.learner.rank import LearnerRank
from groupflow.learner.zero_models import RankSetup

log = logging.getLogger(__name__)


class LearnerRankActor(SyncHost):
    def address(self) -> tuple[str, int]:
        """This node's address and a free port, for rank 0's rendezvous."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init(self, setup: RankSetup, cfg: Config) -> None:
        import torch

        pin_to_cores(cfg.learner.resources.cpu_cores)
        torch.set_num_threads(cfg.learner.resources.threads)
        self.rank = LearnerRank(setup, cfg)

    def train_step(
        self, minibatches: list[list[list[TrainSequence]]], lr: float | None = None
    ) -> RankFigures:
        return self.rank.train_step(minibatches, lr)

    def micro_batch_tokens(self) -> tuple[int, bool]:
        return self.rank.micro_batch_tokens()

    def checkpointing_line(self) -> str:
        return self.rank.checkpointing_line

    def weight_sync(self, step: Callable, *args):
        """Run a weight transport's rank-side `step` here, `step(self, *args)`
        (actors/transport.py: a transport's steps, and what of this actor they use: `rank`
        and `sync_state`)."""
        return step(self, *args)

    def save_pretrained(self, path: str) -> None:
        self.rank.save_pretrained(path)

    def save_checkpoint(self, directory: str) -> None:
        self.rank.save_checkpoint(directory)

    def load_checkpoint(self, directory: str) -> str | None:
        return self.rank.load_checkpoint(directory)

    def weight_manifest(self) -> list:
        return self.rank.weight_manifest()

    def sent_checksums(self) -> dict:
        """This rank's shares of the checksums of the last sync it sent (called after it: an
        actor runs its calls in order)."""
        return self.rank.sent_checksums

    def probe_logprobs(self) -> list[list[float]]:
        """The policy's log-probs of the sync probe at the weights it holds (collective)."""
        return self.rank.probe_logprobs()


def ray_get_ready(placement: PlacementGroup) -> None:
    """Wait for the placement group, however long a node takes to join (a rebuild after the
    ranks' node was lost); a wait past NOTE_AFTER_S is said once, with what the cluster has."""
    if placement.wait(timeout_seconds=NOTE_AFTER_S):
        return
    bundle = placement.bundle_specs[0]
    nodes, free = live_nodes()
    log.warning(
        "the learner's %d ranks wait for room on the cluster: each asks %s (learner.resources); "
        "the cluster has %s",
        len(placement.bundle_specs),
        describe_demand(bundle),
        describe_cluster(nodes, free, bundle),
    )
    ray.get(placement.ready())


class LearnerGroup:
    """`learner.num_ranks` ranks packed into one placement group, called collectively."""

    def __init__(
        self,
        cfg: Config,
        model_path: str,
        placed: Callable[[PlacementGroup], None] = ray_get_ready,
    ):
        self.cfg = cfg
        self.model_path = model_path
        self._start(placed)
        self._refuse_sequences_that_cannot_fit()

    def _refuse_sequences_that_cannot_fit(self) -> None:
        """With micro_batch_tokens: auto, a job whose longest sequence cannot fit a micro-batch
        of its own in the ranks' memory ends before training, in one line."""
        if self.cfg.learner.micro_batch_tokens != "auto":
            return
        try:
            check_longest_fits(
                self._micro_batch_tokens(),
                self.cfg.rollout.max_model_len,
                self.cfg.learner.memory_gib,
            )
        except ConfigError:
            self.shutdown()
            raise

    def checkpointing_line(self) -> str:
        """Whether the ranks checkpoint their layers, and with `auto` why (rank 0's choice:
        the ranks share one memory setting and one model)."""
        [line] = RayFutures().get([self.ranks[0].checkpointing_line.remote()])
        return line

    def _micro_batch_tokens(self) -> int:
        """The micro-batch budget in positions: learner.micro_batch_tokens, or with auto the
        smallest of the ranks' (their estimate until a step measured it; asked again until
        then, after the step: a rank answers once its calls before are done)."""
        setting = self.cfg.learner.micro_batch_tokens
        if setting != "auto":
            return setting
        if self._budget is None or not self._budget_measured:
            answers = RayFutures().get([r.micro_batch_tokens.remote() for r in self.ranks])
            self._budget = min(b for b, _ in answers)
            self._budget_measured = all(measured for _, measured in answers)
        return self._budget

    def _start(self, placed: Callable[[PlacementGroup], None] = ray_get_ready) -> None:
        """`placed` waits for the ranks' placement group: at the job's start, the startup
        check (actors/placement.py, with a deadline); in a rebuild, as long as a node takes."""
        res = self.cfg.learner.resources
        n = self.cfg.learner.num_ranks
        bundle = {
            "CPU": res.num_cpus,
            **({"GPU": res.num_gpus} if res.num_gpus else {}),
            **res.custom,
        }
        self.placement = placement_group([bundle] * n, strategy="PACK")
        self.ranks = []
        self._budget: int | None = None  # micro_batch_tokens: auto, the ranks' budget
        self._budget_measured = False
        try:
            self._start_ranks(placed)
        except BaseException:  # nothing is left holding the cluster's resources
            self.shutdown()
            raise

    def _start_ranks(self, placed: Callable[[PlacementGroup], None]) -> None:
        cfg, model_path = self.cfg, self.model_path
        res, n = cfg.learner.resources, cfg.learner.num_ranks
        placed(self.placement)
        actor = ray.remote(LearnerRankActor)
        device = device_for(res.num_gpus)
        env = thread_env(res.threads)
        if device.kind == "cpu":
            env.update(allocator_env())
        self.ranks = [
            actor.options(
                num_cpus=res.num_cpus,
                num_gpus=res.num_gpus,
                resources=res.custom,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, i),
                runtime_env={"env_vars": env},
            ).remote()
            for i in range(n)
        ]
        [(addr, port)] = wait_started("learner rank", [self.ranks[0].address.remote()])
        wait_started(
            "learner rank",
            [
                r.init.remote(
                    RankSetup(
                        model_path=model_path,
                        rank=i,
                        world_size=n,
                        master_addr=addr,
                        master_port=port,
                        device=device,
                    ),
                    cfg,
                )
                for i, r in enumerate(self.ranks)
            ],
        )

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    def async_train_step(
        self, sequences: list[TrainSequence], lr: float | None = None
    ) -> list[ray.ObjectRef]:
        """Start one step on every rank at learning rate `lr` (None: the current one), the
        sequences balanced by tokens; a reference per rank's RankFigures."""
        shards = self.cfg.learner.sequence_parallel_size  # a group's ranks share its layout
        layout = layout_step(
            [len(s.input_ids) for s in sequences],
            [s.group_id for s in sequences],
            len(self.ranks) // shards,
            self.cfg.learner.mini_batches_per_step,
            max(1, self._micro_batch_tokens()),
            packed=self.cfg.learner.pack_sequences,
            sequence_parallel=shards,
        )
        shares = [
            [[[sequences[i] for i in micro] for micro in mini] for mini in rank_layout]
            for rank_layout in layout
        ]
        return [r.train_step.remote(shares[i // shards], lr) for i, r in enumerate(self.ranks)]

    def async_sent_checksums(self) -> list[ray.ObjectRef]:
        """Each rank's shares of the checksums of the sync it sent last (call after starting
        that sync: each rank answers once its side of it is done)."""
        return [r.sent_checksums.remote() for r in self.ranks]

    def async_probe_logprobs(self) -> ray.ObjectRef:
        """The policy's log-probs of the sync probe at the weights of the sync it sent last
        (call after starting that sync): taken in the step that made them, or by every rank
        now where it has not stepped since it started. Rank 0's answer."""
        return [r.probe_logprobs.remote() for r in self.ranks][0]

    def save_pretrained(self, path: str) -> None:
        """The policy in Hugging Face format; a failed write is the rank's one line."""
        RayFutures().get([r.save_pretrained.remote(path) for r in self.ranks])

    def async_save_checkpoint(self, directory: str) -> list[ray.ObjectRef]:
        """Every rank writes its shards under `directory` (collective); a reference each."""
        return [r.save_checkpoint.remote(directory) for r in self.ranks]

    def load_checkpoint(self, directory: str) -> None:
        """Every rank loads its shards (collective); a refused file is the rank's one line.
        The ranks' notes (the same on each) are logged here, where the user sees them."""
        notes = RayFutures().get([r.load_checkpoint.remote(directory) for r in self.ranks])
        for note in dict.fromkeys(n for n in notes if n is not None):
            log.info("%s", note)

    def restart(self) -> None:
        """New ranks on the base model, in place of ranks of which one died: ZeRO-3 ranks
        cannot go on without a shard, and the survivors may hang in a collective."""
        self.shutdown()
        self._start()

    def shutdown(self) -> None:
        for r in self.ranks:
            ray.kill(r)
        ray.util.remove_placement_group(self.placement)
