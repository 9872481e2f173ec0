"""The wire format of a weight sync, shared by the learner that sends it (learner/weight_export.py),
the engines that receive it (rollout/weight_intake.py) and the transports between them
(actors/transport.py): how the model is cut into buckets, how a bucket travels, and the
checksums that prove an engine loaded what the learner sent.

A bucket is whole transformer layers of one dtype, up to a byte budget (one layer larger than
that is a bucket of its own), named by a manifest of (name, full shape, dtype) in send order:
an engine loads each bucket as it arrives, and vLLM, which fuses a layer's q/k/v and gate/up
projections, always receives a layer complete. A bucket travels as one flat tensor, or as the
learner ranks' ZeRO-3 partitions of it, one flat tensor each: rank r holds elements
[r*s, (r+1)*s) of every flattened parameter, s = ceil(numel / world), zeros past the end.

The checksum of a tensor is two sums over its bytes read as little-endian 64-bit words (the
last one padded with zeros), modulo 2^64: the plain sum, which any change of a single bit
changes, and the sum weighted by each word's position, which moved or swapped words change.
Both are sums, so a partition's share is computed where it lies, from its own offset, and the
shares of all ranks add up to the whole tensor's: no rank has to gather a parameter to
checksum it, and on a GPU no byte leaves the device but the two sums. Words, whatever the
dtype, because summing 64-bit integers is as fast as summing floats (a 16-bit dtype widened
element by element is tens of times slower on CPU).
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import groupby
from typing import Protocol

import torch

from groupflow.core.errors import UserError

DEFAULT_BUCKET_BYTES = 64 * 2**20

Entry = tuple[str, tuple[int, ...], str]  # (name, full shape, dtype)
Manifest = list[Entry]  # in send order; a bucket is a Manifest too

Checksum = tuple[int, int]  # (sum, position-weighted sum) of the element bits, mod 2^64
Checksums = dict[str, Checksum]  # by tensor name


class PendingTransfer(Protocol):
    def wait(self) -> None: ...


class Broadcaster(Protocol):
    """A process group in which rank 0 is the source of a broadcast (actors/transport_collective.py
    WeightGroup)."""

    def start_broadcast(self, tensor: torch.Tensor) -> PendingTransfer:
        """Start sending `tensor` from rank 0, or receiving into it in place on the others (it
        must stay untouched until the transfer is waited on)."""
        ...


_LAYER = re.compile(r"^(.*?\.\d+)\.")  # "model.layers.3.mlp.up_proj.weight" -> "model.layers.3"


def layer_of(name: str) -> str:
    """The unit a bucket never splits: a numbered layer, or else the parameter itself."""
    match = _LAYER.match(name)
    return match.group(1) if match else name.rsplit(".", 1)[0]


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def bucket_manifest(manifest: Manifest, bucket_bytes: int) -> list[Manifest]:
    """`manifest` cut into buckets of whole layers, each up to `bucket_bytes` (or one layer).

    A bucket travels as one flat tensor, so a change of dtype also starts a new one."""
    buckets: list[Manifest] = []
    size = 0
    # A unit: consecutive entries of one layer in one dtype.
    for _, entries in groupby(manifest, key=lambda e: (layer_of(e[0]), e[2])):
        unit = list(entries)
        nbytes = sum(_nbytes(shape, dtype) for _, shape, dtype in unit)
        if not buckets or unit[0][2] != buckets[-1][0][2] or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].extend(unit)
        size += nbytes
    return buckets


def partition_sizes(bucket: Manifest, world: int) -> list[int]:
    """Elements of each parameter in one rank's partition of `bucket`."""
    return [math.ceil(torch.Size(shape).numel() / world) for _, shape, _ in bucket]


def sync_bytes(buckets: list[Manifest], world: int) -> int:
    """Bytes one sync of `buckets` sends: each bucket as `world` partitions (1: whole), each
    parameter's partitions padded to equal size."""
    return sum(
        size * world * _nbytes((), bucket[0][2])
        for bucket in buckets
        for size in partition_sizes(bucket, world)
    )


def unpack_bucket(
    shards: Sequence[torch.Tensor], bucket: Manifest
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a bucket that travelled as flat tensors: the ranks' partitions
    in rank order, or the whole bucket as the one shard. With one shard the tensors are views
    of it; with several, each parameter is put together from its partitions (one copy)."""
    world = len(shards)
    sizes = partition_sizes(bucket, world)
    for rank, shard in enumerate(shards):
        if shard.numel() != sum(sizes):
            raise ValueError(
                f"weight bucket from {bucket[0][0]} on: shard {rank} of {world} holds "
                f"{shard.numel()} elements, the manifest {sum(sizes)}"
            )
    parts = [shard.split(sizes) for shard in shards]
    for i, (name, shape, _) in enumerate(bucket):
        shape = torch.Size(shape)
        pieces = [p[i] for p in parts]
        whole = pieces[0] if world == 1 else torch.cat(pieces)[: shape.numel()]
        yield name, whole.view(shape)


def bytes_tensor(array) -> torch.Tensor:
    """A uint8 tensor over a byte array without a copy. Ray's object store hands out read-only
    arrays; the tensor is only read (vLLM copies it into its weights), so torch's warning
    about writes through it does not apply."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


# ----- checksums -----------------------------------------------------------------------------

_MOD = 2**64
_WORD = 8  # bytes
_ROW = 1024  # words: the sums run over rows and columns of this width, so no temporary is large


def checksum(tensor: torch.Tensor, start: int = 0) -> Checksum:
    """The checksum (module doc) of `tensor`'s elements, flattened, as elements `start`,
    `start` + 1, ... of a larger tensor (a partition of it); computed where the tensor lies."""
    flat = tensor.detach().reshape(-1)
    data = flat.view(torch.uint8)
    first_byte = start * flat.element_size()
    head = min((-first_byte) % _WORD, data.numel())  # bytes before the first whole word
    whole = (data.numel() - head) // _WORD * _WORD
    total, weighted = _word_sums(data[head : head + whole], (first_byte + head) // _WORD)
    # the bytes of words this partition shares with its neighbours, each at its place
    offsets = [*range(head), *range(head + whole, data.numel())]
    loose = torch.cat([data[:head], data[head + whole :]]).tolist()  # one transfer
    for offset, value in zip(offsets, loose, strict=True):
        byte = first_byte + offset
        value <<= 8 * (byte % _WORD)
        total += value
        weighted += (byte // _WORD) * value
    return total % _MOD, weighted % _MOD


def _word_sums(data: torch.Tensor, first_word: int) -> tuple[int, int]:
    """(sum, position-weighted sum) of the words of `data` (whole words of bytes), the first
    at position `first_word`. int64 arithmetic wraps around: exact modulo 2^64."""
    if data.numel() == 0:
        return 0, 0
    try:
        words = data.view(torch.int64)
    except RuntimeError:  # not on a word boundary in memory
        words = data.clone().view(torch.int64)
    rows = words.numel() // _ROW
    grid, rest = words[: rows * _ROW].view(rows, _ROW), words[rows * _ROW :]
    row_sums, column_sums = grid.sum(1), grid.sum(0)
    position = partial(torch.arange, dtype=torch.int64, device=words.device)
    total = int(row_sums.sum()) + int(rest.sum())
    # the word at (r, c) is at position r * _ROW + c
    weighted = (
        _ROW * int((row_sums * position(rows)).sum())
        + int((column_sums * position(_ROW)).sum())
        + int((rest * position(rows * _ROW, words.numel())).sum())
    )
    return total, weighted + first_word * total


# Tensors of at most this many words are checksummed together (`checksums`), in batches of
# about this many words: a handful of operations per batch instead of a dozen per tensor,
# which is what a sync of many small tensors (LoRA's matrices, norms, biases) would spend.
_SMALL_WORDS = 1 << 17
_BATCH_WORDS = 1 << 20


def checksums(parts: Iterable[tuple[str, torch.Tensor, int]]) -> Checksums:
    """`checksum(tensor, start)` of each (name, tensor, start), the same numbers, with the
    small tensors that lie on whole words summed a batch at a time."""
    out: Checksums = {}
    batch: list[tuple[str, torch.Tensor, int]] = []  # (name, bytes, first word)
    words = 0
    for name, tensor, start in parts:
        data = tensor.detach().reshape(-1).view(torch.uint8)
        first_byte = start * tensor.element_size()
        if data.numel() % _WORD or first_byte % _WORD or data.numel() > _SMALL_WORDS * _WORD:
            out[name] = checksum(tensor, start)
            continue
        batch.append((name, data, first_byte // _WORD))
        words += data.numel() // _WORD
        if words >= _BATCH_WORDS:
            out.update(_batch_checksums(batch))
            batch, words = [], 0
    if batch:
        out.update(_batch_checksums(batch))
    return out


def _batch_checksums(batch: list[tuple[str, torch.Tensor, int]]) -> Checksums:
    """Checksums of whole-word tensors (bytes, position of the first word) from two running
    sums over their words laid end to end, C = cumsum(words) and D = cumsum(C): the words
    w_s..w_{e-1} of a tensor sum to T = C_{e-1} - C_{s-1}, and weighted by their place in it to
    sum_j j w_{s+j} = (e - s - 1) T - sum_{i=s}^{e-2} (C_i - C_{s-1}), read off D. int64 wraps
    around: exact modulo 2^64. Two passes over the words, no per-word product."""
    words = torch.cat([data for _, data, _ in batch]).view(torch.int64)
    running = torch.cumsum(words, 0)
    twice = torch.cumsum(running, 0)
    spans, at = [], 0
    for _, data, _ in batch:
        spans.append((at, at + data.numel() // _WORD))
        at = spans[-1][1]
    c = _values_at(running, [i for s, e in spans for i in (s - 1, e - 1)])
    d = _values_at(twice, [i for s, e in spans for i in (s - 1, e - 2)])
    out: Checksums = {}
    for k, ((name, _, first), (s, e)) in enumerate(zip(batch, spans, strict=True)):
        c_before, c_last, d_before, d_second_last = c[2 * k], c[2 * k + 1], d[2 * k], d[2 * k + 1]
        total = c_last - c_before
        prefixes = d_second_last - d_before - (e - s - 1) * c_before
        weighted = (e - s - 1) * total - prefixes
        out[name] = (total % _MOD, (weighted + first * total) % _MOD)
    return out


def _values_at(sums: torch.Tensor, indices: list[int]) -> list[int]:
    """sums[i] for each index, 0 for -1 (before the first word), in one read."""
    values = sums[torch.tensor([max(i, 0) for i in indices], device=sums.device)].tolist()
    return [0 if i < 0 else v for i, v in zip(indices, values, strict=True)]


def shard_checksums(shard: torch.Tensor, bucket: Manifest, rank: int, world: int) -> Checksums:
    """Each parameter's share of its checksum in rank `rank`'s partition of `bucket` (the
    whole bucket with rank 0 of 1). The shares of every rank add up (`add_checksums`) to the
    checksum of the whole parameter."""
    sizes = partition_sizes(bucket, world)
    return checksums(
        (name, part, rank * size)
        for (name, _, _), part, size in zip(bucket, shard.split(sizes), sizes, strict=True)
    )


def add_checksums(shares: Sequence[Mapping[str, Checksum]]) -> Checksums:
    """The checksums of whole tensors from the shares of their partitions."""
    out: Checksums = {}
    for share in shares:
        for name, (total, weighted) in share.items():
            was = out.get(name, (0, 0))
            out[name] = ((was[0] + total) % _MOD, (was[1] + weighted) % _MOD)
    return out


@dataclass
class LoadedWeights:
    """What an engine reports after loading a sync: the version, per tensor the checksum of
    the bytes it loaded, and its log-probs of the sync probe with the weights loaded
    (groupflow/core/sync_probe.py; None where it scored none)."""

    version: int
    checksums: Checksums = field(default_factory=dict)
    probe: list[list[float]] | None = None
    # a tensor-parallel engine's workers, by rank, each loading its parts only
    workers: list[WorkerLoad] = field(default_factory=list)


@dataclass
class WorkerLoad:
    """One tensor-parallel worker's side of a load (rollout/shard_stream.py): the bytes of the
    parts it received, and the most resident memory it held above its start while loading."""

    rank: int
    received_bytes: int
    peak_extra_bytes: int


class WeightSyncMismatch(UserError):
    """An engine loaded other weights than the learner sent: the job must not sample on."""

    exit_code = 1


def check_loaded(sent: Mapping[str, Checksum], loaded: LoadedWeights, engine: str) -> None:
    """Raise WeightSyncMismatch, one line naming `engine`, the version and the first tensor,
    unless the engine loaded every tensor the learner sent, bit for bit, and nothing else."""
    for name in sorted(sent.keys() | loaded.checksums.keys()):
        want, got = sent.get(name), loaded.checksums.get(name)
        if want != got:
            what = (
                "did not load it"
                if got is None
                else "loaded a tensor the learner did not send"
                if want is None
                else f"loaded checksum {_hex(got)}, the learner sent {_hex(want)}"
            )
            raise WeightSyncMismatch(
                f"weight sync of policy version {loaded.version}: {engine}: tensor {name}: {what}"
            )


def _hex(value: Checksum) -> str:
    return f"{value[0]:016x}/{value[1]:016x}"
