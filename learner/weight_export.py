"""Parameters out of a ZeRO-3 engine, a bucket at a time: each rank's own partitions to Ray's
object store (actors/transport.py), or full parameters to a broadcast group of inference
engines or to a Hugging Face directory.

`shard_buckets` is local: each rank sends its partition of every bucket and the engines put
the partitions back together (`unpack_bucket`), so nothing is gathered among the ranks and
each rank sends 1/world of the model. The other functions are collective: every rank gathers
each bucket together, in the order of `module.named_parameters()`, and only the source rank
(rank 0) keeps or sends it. A bucket is
whole transformer layers up to `bucket_bytes` (one layer larger than that is a bucket of its
own): an engine then loads each bucket as it arrives, and vLLM, which fuses a layer's q/k/v and
gate/up projections, always receives a layer complete. Broadcasting, rank 0 holds at most two
buckets, the one in transfer and the next one being gathered, never a second copy of the model.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Iterator, Sequence
from itertools import groupby
from typing import Protocol

import torch

DEFAULT_BUCKET_BYTES = 64 * 2**20

Manifest = list[tuple[str, tuple[int, ...], str]]  # (name, full shape, dtype) in send order


class PendingTransfer(Protocol):
    def wait(self) -> None: ...


class Broadcaster(Protocol):
    """A process group in which this rank is the source of a broadcast."""

    def start_broadcast(self, tensor: torch.Tensor) -> PendingTransfer:
        """Start sending `tensor` (it must stay untouched until the transfer is waited on)."""
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


def weight_manifest(module) -> Manifest:
    """(name, full shape, dtype) of every parameter, in send order. Local: no gather."""
    return [
        (name, tuple(getattr(p, "ds_shape", p.shape)), str(p.dtype).removeprefix("torch."))
        for name, p in module.named_parameters()
    ]


def _parameter_buckets(module, bucket_bytes: int) -> Iterator[list[tuple[str, torch.nn.Parameter]]]:
    params = dict(module.named_parameters())
    for bucket in bucket_manifest(weight_manifest(module), bucket_bytes):
        yield [(name, params[name]) for name, _, _ in bucket]


def unpack_bucket(
    shards: Sequence[torch.Tensor], bucket: Manifest
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a bucket that travelled as flat tensors: the ranks' partitions
    in rank order (`shard_buckets`), or the whole bucket as the one shard (`flat_buckets`).
    With one shard the tensors are views of it; with several, each parameter is put together
    from its partitions (one copy)."""
    world = len(shards)
    shapes = [torch.Size(shape) for _, shape, _ in bucket]
    sizes = [math.ceil(s.numel() / world) for s in shapes]
    for rank, shard in enumerate(shards):
        if shard.numel() != sum(sizes):
            raise ValueError(
                f"weight bucket from {bucket[0][0]} on: shard {rank} of {world} holds "
                f"{shard.numel()} elements, the manifest {sum(sizes)}"
            )
    parts = [shard.split(sizes) for shard in shards]
    for i, ((name, _, _), shape) in enumerate(zip(bucket, shapes, strict=True)):
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


def shard_buckets(module, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[torch.Tensor]:
    """This rank's partition of each bucket (`bucket_manifest`), as one flat tensor: no gather
    and no collective. ZeRO-3 keeps in `param.ds_tensor` elements [r*s, (r+1)*s) of the
    flattened parameter on rank r, with s = ceil(numel / world) and zeros past the end; the
    optimizer step writes the new values there, so it is current between steps even where a
    full copy of the parameter is kept (persistent parameters)."""
    for bucket in _parameter_buckets(module, bucket_bytes):
        yield joined([p.ds_tensor.detach() for _, p in bucket])


def joined(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """`tensors` flattened into one: a view of their memory where they lie back to back in one
    buffer, as a rank's ZeRO-3 partitions do (DeepSpeed keeps them in one flat buffer, in
    parameter order), so no copy is made; else a copy."""
    first = tensors[0]
    storage = first.untyped_storage()
    end = first.data_ptr()
    for t in tensors:
        if not t.is_contiguous() or t.untyped_storage().data_ptr() != storage.data_ptr():
            break
        if t.dtype != first.dtype or t.data_ptr() != end:
            break
        end += t.numel() * t.element_size()
    else:
        numel = (end - first.data_ptr()) // first.element_size()
        return first.new_empty(0).set_(storage, first.storage_offset(), (numel,))
    return torch.cat([t.reshape(-1) for t in tensors])


def flat_buckets(
    module, is_source: bool, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[torch.Tensor | None]:
    """Each bucket gathered and laid into one flat tensor on the source rank (None on the
    others, which must run the generator to the end: the gathers are collective); the next
    bucket is gathered only when the consumer asks for it. `bucket_manifest` of
    `weight_manifest` names what each holds."""
    import deepspeed

    for bucket in _parameter_buckets(module, bucket_bytes):
        with deepspeed.zero.GatheredParameters([p for _, p in bucket], modifier_rank=None):
            flat = torch.cat([p.detach().reshape(-1) for _, p in bucket]) if is_source else None
        yield flat


def weight_buckets(
    module, is_source: bool, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Full parameters in Hugging Face names, one bucket at a time, as CPU copies on the source
    rank; the other ranks yield nothing but must run the generator to the end (the gathers
    are collective). The next bucket is gathered only when the consumer asks for it."""
    import deepspeed

    for bucket in _parameter_buckets(module, bucket_bytes):
        with deepspeed.zero.GatheredParameters([p for _, p in bucket], modifier_rank=None):
            copies = [(n, p.detach().to("cpu", copy=True)) for n, p in bucket if is_source]
        if is_source:
            yield copies


def broadcast_weights(
    module, group: Broadcaster | None, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> None:
    """Gather bucket after bucket; where `group` is given (the source rank), send each one as
    a single flat tensor while the next one is gathered. The engines cut the same buckets from
    the same manifest (bucket_manifest)."""
    in_flight: tuple[torch.Tensor, PendingTransfer] | None = None
    for flat in flat_buckets(module, group is not None, bucket_bytes):
        if in_flight is not None:
            in_flight[1].wait()
        if group is not None:
            in_flight = (flat, group.start_broadcast(flat))
    if in_flight is not None:
        in_flight[1].wait()


def gathered_weights(module, is_source: bool) -> list[tuple[str, torch.Tensor]] | None:
    """The whole model on the source rank (None elsewhere), gathered bucket by bucket: what
    a Hugging Face export saves."""
    weights = [pair for bucket in weight_buckets(module, is_source) for pair in bucket]
    return weights if is_source else None


def save_pretrained(module, is_source: bool, path: str) -> None:
    """The current policy in Hugging Face format, written by the source rank."""
    weights = gathered_weights(module, is_source)
    if weights is not None:
        module.save_pretrained(path, state_dict=dict(weights))
