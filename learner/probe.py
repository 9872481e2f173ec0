"""The learner's side of the sync probe (groupflow/core/sync_probe.py): its log-probs of the probe
with the weights a sync will send, taken in the step that made them."""

from __future__ import annotations

import torch

from groupflow.core.records import TrainSequence
from groupflow.core.sync_probe import Probe, ProbeLogprobs
from groupflow.learner.micro_batch import response_token_stats
from groupflow.learner.sequence_parallel import SequenceParallel


def probe_logprobs(
    model, probe: Probe, device: torch.device, packed: bool, sp: SequenceParallel | None = None
) -> ProbeLogprobs:
    """The log-prob (temperature 1) of each token of each probe sequence after its first,
    under `model`: one forward without a graph. Every rank calls it (ZeRO-3's gathers are
    collective; with `sp`, each rank of a sequence-parallel group its shard)."""
    # Each sequence as a response to its first token: its log-probs are those of the rest.
    seqs = [TrainSequence(ids, 1, 0.0, i, 0, []) for i, ids in enumerate(probe)]
    with torch.no_grad():
        stats = response_token_stats(model, seqs, 1.0, device, False, packed, sp)
    return [s.logp.double().tolist() for s in stats]
