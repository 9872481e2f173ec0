"""Weight sync from the learner to the engines (groupflow.core.peers.WeightSync): what every
transport shares, and how a transport's steps reach the actors at both ends.

A transport is one file, actors/transport_<name>.py, and one line of the table in
actors/transport_registry.py, under the name `rollout.weight_transport` gives it. The file
holds the three sides of a sync: the driver's, a `WeightTransport` (`async_sync` starts a sync
and returns at once with references the caller waits on), and the learner ranks' and the
engines', functions it sends to those actors (by reference: they are the file's own), which
each runs on itself with its `weight_sync` method, keeping what it needs between its steps in
`sync_state` (`SyncHost`).

Every transport sends the model in buckets of whole layers (groupflow/core/weight_format.py) of up to
`rollout.weight_bucket_mb`, cut once from learner rank 0's manifest and handed to the ranks and
the engines alike, so no learner rank holds a second copy of the model. A chunk sent to an
engine after a sync samples once that sync is loaded (actors/generator_actor.py,
`min_version`). Every load is verified (`check_load`): the engine reports the checksum of each
tensor it loaded, the ranks theirs of what they sent, and one that differs stops the job; and
the engine's log-probs of the sync probe with the weights loaded must be the learner's
(groupflow/core/sync_probe.py), or that stops the job too.
"""

from __future__ import annotations

import logging
from typing import TypeVar

import ray

from groupflow.actors.futures import RayFutures
from groupflow.core.peers import SyncHandles
from groupflow.core.sync_probe import (
    ProbeAgreement,
    check_probe,
    compare_probe,
    job_probe,
    probe_figures,
)
from groupflow.core.weight_format import (
    DEFAULT_BUCKET_BYTES,
    LoadedWeights,
    Manifest,
    add_checksums,
    bucket_manifest,
    check_loaded,
    sync_bytes,
)

log = logging.getLogger(__name__)

State = TypeVar("State")


class SyncHost:
    """An actor at either end of a sync (a generator, a learner rank), as a transport's steps
    see it. The actor's `weight_sync(step, *args)` runs `step(actor, *args)`; here the state a
    transport keeps in the actor between its steps (its process group, the buckets arriving)."""

    def sync_state(self, kind: type[State]) -> State:
        """This actor's one `kind` (a transport's class of state), made on first use."""
        states = vars(self).setdefault("_sync_states", {})
        if kind not in states:
            states[kind] = kind()
        return states[kind]


class WeightTransport:
    """What every transport shares: the buckets, cut once, and the check of every load.
    `learner` is the learner group (actors/learner.py LearnerGroup), `engines` the generator
    pool's list of engines."""

    # Whether the actors it syncs may change while the job runs: engines replaced or added
    # (rollout.autoscale, `groupflow scale --engines`) and the learner ranks rebuilt. A
    # transport whose members are fixed once it opens (a process group) ends the job instead.
    elastic: bool = False

    def __init__(self, learner, engines: list, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.learner = learner
        self.engines = engines  # the generator pool's list: a slot may hold a replacement
        manifest = ray.get(learner.ranks[0].weight_manifest.remote())
        self.buckets: list[Manifest] = bucket_manifest(manifest, bucket_bytes)
        self.bytes_per_sync = sync_bytes(self.buckets, self._partitions)
        log.info(
            "a weight sync sends %d tensors, %.1f MiB in %d buckets",
            len(manifest),
            self.bytes_per_sync / 2**20,
            len(self.buckets),
        )
        # A load not checked yet -> (the engine, in words; the ranks' checksum shares; the
        # learner's log-probs of the sync probe).
        self._loads: dict[ray.ObjectRef, tuple[str, list[ray.ObjectRef], ray.ObjectRef]] = {}
        cfg = learner.cfg
        self.probe = job_probe(learner.model_path, cfg.trainer.seed, cfg.rollout.max_model_len)
        self._probed: list[ProbeAgreement] = []  # the loads probed since `probe_figures`

    @property
    def _partitions(self) -> int:
        """Flat tensors a bucket travels as."""
        raise NotImplementedError

    def async_sync(self, version: int, engines: list) -> SyncHandles:
        raise NotImplementedError

    def _note(self, engines: list, loads: list[ray.ObjectRef]) -> None:
        """Keep what checking `loads` takes: the ranks answer once their side is done."""
        sent = self.learner.async_sent_checksums()
        probe = self.learner.async_probe_logprobs()
        for engine, load in zip(engines, loads, strict=True):
            self._loads[load] = (self._describe(engine), sent, probe)

    def _describe(self, engine) -> str:
        slot = next((i for i, e in enumerate(self.engines) if e is engine), None)
        return f"engine {slot} (actor {engine._actor_id.hex()[:12]})"

    def check_load(self, load: ray.ObjectRef, loaded: LoadedWeights | None) -> bool:
        """Check an engine's finished load (the value of its handle) against what the ranks
        sent; True where it was checked and matched, False for a load abandoned with a broken
        stream (the learner's failure, reported on its side). A mismatch raises
        WeightSyncMismatch: one line naming the engine, the version and the tensor, or the
        worst token of the sync probe (SyncProbeMismatch)."""
        engine, sent, probe = self._loads.pop(load)
        if loaded is None:
            return False
        check_loaded(add_checksums(RayFutures().get(sent)), loaded, engine)
        if loaded.probe is not None:  # None: a later load landed before the engine scored it
            [learner] = RayFutures().get([probe])
            agreement = compare_probe(self.probe, loaded.probe, learner)
            self._probed.append(agreement)
            check_probe(agreement, self.learner.cfg.model.dtype, engine, loaded.version)
        return True

    def probe_figures(self) -> dict[str, float]:
        """The sync probe's figures over the loads checked since the last call."""
        probed, self._probed = self._probed, []
        return probe_figures(probed)

    def forget(self, load: ray.ObjectRef) -> None:
        """A load that will never be checked (its engine died)."""
        self._loads.pop(load, None)
