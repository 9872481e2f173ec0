"""The sync probe: a weight load verified by what the engine computes with it.

A load's checksums (groupflow/core/weight_format.py) prove that an engine was handed the bytes the
learner sent; they cannot see how vLLM lays those bytes into its own layers (fused q/k/v and
gate/up projections, expert blocks, the layouts its kernels pack weights into). A wrong name
mapping or layout there leaves every checksum matching while the engine samples from other
weights than the learner trains. So after every load each engine scores a probe, a few token
sequences drawn once per job (`draw_probe`), and returns the log-prob of each of their tokens
after the first; the learner scores the same probe with the same weights in the step that made
them; and the driver compares the two (`compare_probe`, in float64) against a tolerance set by
the weights' dtype (`PROBE_TOLERANCE`). Both sides draw the probe themselves, from the model
directory and the job's seed, so that it never travels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from groupflow.core.weight_format import WeightSyncMismatch

PROBE_SEQUENCES = 4
PROBE_TOKENS = 32  # per sequence, at most: fewer where rollout.max_model_len is shorter

# dtype -> (largest mean, largest single) |engine - learner| log-prob over the probe's tokens,
# in nats. Float noise between vLLM's kernels and the learner's is about 1e-6 in float32
# (5e-7 mean on the quickstart model and on the small mixture of experts); a 16-bit dtype
# rounds each logit to 2-3 significant digits, so its bounds are those of the rounding, not of
# a layout error, which moves most tokens by far more on a trained model.
PROBE_TOLERANCE: dict[str, tuple[float, float]] = {
    "float32": (1e-4, 1e-2),
    "float16": (2e-2, 1.0),
    "bfloat16": (1e-1, 2.0),
}

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

Probe = list[list[int]]  # token ids, one list per sequence
ProbeLogprobs = list[list[float]]  # per sequence, the log-prob of each token after the first


def probe_length(max_model_len: int) -> int:
    """Tokens per probe sequence: the engine scores it as a prompt with one token to sample."""
    return max(2, min(PROBE_TOKENS, max_model_len - 1))


def draw_probe(vocabulary: int, seed: int, length: int) -> Probe:
    """The job's probe: PROBE_SEQUENCES sequences of `length` token ids below `vocabulary`,
    drawn from `seed` alone, so that the engines and the learner draw the same one."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocabulary, (PROBE_SEQUENCES, length), generator=gen)
    return ids.tolist()


def probe_vocabulary(model_path: str) -> int:
    """The token ids a probe may hold: those of both the model's embedding and its tokenizer
    (a model may have more rows than tokens, and engines refuse an id past the tokenizer's).
    A directory without a tokenizer, which no engine serves (a learner-only benchmark's),
    holds the embedding's."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model_path).get_text_config()
    # (transformers makes an empty tokenizer of a directory without one, rather than fail)
    if not any((Path(model_path) / f).is_file() for f in TOKENIZER_FILES):
        return config.vocab_size
    return min(config.vocab_size, len(AutoTokenizer.from_pretrained(model_path)))


def job_probe(model_path: str, seed: int, max_model_len: int) -> Probe:
    """The probe of a job on `model_path` (trainer.seed, rollout.max_model_len)."""
    return draw_probe(probe_vocabulary(model_path), seed, probe_length(max_model_len))


@dataclass(frozen=True)
class ProbeAgreement:
    """How far an engine's log-probs of the probe are from the learner's."""

    mean: float  # mean |engine - learner| over the probe's tokens
    max: float  # the largest
    sequence: int  # where the largest is: the sequence,
    position: int  # the token's position in it,
    token: int  # its id,
    engine: float  # and both log-probs of it
    learner: float


def compare_probe(probe: Probe, engine: ProbeLogprobs, learner: ProbeLogprobs) -> ProbeAgreement:
    """The engine's log-probs against the learner's, in float64. A missing or non-finite
    log-prob is infinitely far."""
    if len(engine) != len(probe) or len(learner) != len(probe):
        raise ValueError(
            f"sync probe: {len(probe)} sequences, the engine scored {len(engine)}, "
            f"the learner {len(learner)}"
        )
    total, count = 0.0, 0
    worst = (-1.0, 0, 0)
    for s, (ids, ours, theirs) in enumerate(zip(probe, engine, learner, strict=True)):
        want = len(ids) - 1
        a = torch.full((want,), math.nan, dtype=torch.float64)
        b = a.clone()
        a[: min(want, len(ours))] = torch.tensor(ours[:want], dtype=torch.float64)
        b[: min(want, len(theirs))] = torch.tensor(theirs[:want], dtype=torch.float64)
        diff = (a - b).abs()
        diff[~torch.isfinite(diff)] = math.inf
        total += float(diff.sum())
        count += want
        at = int(diff.argmax())
        if float(diff[at]) > worst[0]:
            worst = (float(diff[at]), s, at)
    largest, s, at = worst
    return ProbeAgreement(
        mean=total / max(1, count),
        max=largest,
        sequence=s,
        position=at + 1,
        token=probe[s][at + 1],
        engine=_at(engine[s], at),
        learner=_at(learner[s], at),
    )


def _at(values: Sequence[float], i: int) -> float:
    return float(values[i]) if i < len(values) else math.nan


def probe_figures(probed: Sequence[ProbeAgreement]) -> dict[str, float]:
    """The step record's sync probe keys over the loads probed since the previous step: the
    worst of them (none where none was probed)."""
    if not probed:
        return {}
    return {
        "sync_probe_diff_mean": max(a.mean for a in probed),
        "sync_probe_diff_max": max(a.max for a in probed),
    }


class SyncProbeMismatch(WeightSyncMismatch):
    """An engine computes other log-probs than the learner with the weights of one sync."""


def check_probe(agreement: ProbeAgreement, dtype: str, engine: str, version: int) -> None:
    """Raise SyncProbeMismatch, one line naming `engine`, the version and the worst token,
    unless `agreement` is within the tolerance of `dtype`."""
    mean_bound, max_bound = PROBE_TOLERANCE[dtype]
    if agreement.mean <= mean_bound and agreement.max <= max_bound:
        return
    a = agreement
    raise SyncProbeMismatch(
        f"weight sync of policy version {version}: {engine} computes other log-probs than "
        f"the learner with it: sync probe |difference| mean {a.mean:.3g} and max {a.max:.3g} "
        f"nats (a {dtype} sync allows {mean_bound:g} and {max_bound:g}); worst at token "
        f"{a.position} (id {a.token}) of probe sequence {a.sequence}: engine {a.engine:.6g}, "
        f"learner {a.learner:.6g}"
    )
