"""Parameters out of a ZeRO-3 model, a bucket at a time: each rank's own partitions to Ray's
object store (actors/transport_object_store.py), or full parameters to a broadcast group of inference
engines or to a Hugging Face directory. The buckets and how they travel are the wire format
(groupflow/core/weight_format.py); a sync's buckets are cut once, by the transport, and handed to
the ranks and the engines alike.

`shard_buckets` is local: each rank sends its partition of every bucket and the engines put
the partitions back together, so nothing is gathered among the ranks and each rank sends
1/world of the model. The other functions are collective: every rank gathers each bucket
together, in the order of `module.named_parameters()`, and only the source rank (rank 0)
keeps or sends it. Broadcasting, rank 0 holds at most two buckets, the one in transfer and the
next one being gathered, never a second copy of the model.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from groupflow.core.adapters import MERGED_DIR
from groupflow.core.weight_format import (
    DEFAULT_BUCKET_BYTES,
    Broadcaster,
    Checksums,
    Manifest,
    PendingTransfer,
    bucket_manifest,
    shard_checksums,
)
from groupflow.learner.lora import (
    adapter_parameters,
    has_adapters,
    merged_weights,
    save_adapter,
)


def synced_parameters(module) -> dict[str, torch.nn.Parameter]:
    """What a sync sends, by the names it travels under: every parameter, or with LoRA the
    adapter's matrices only (learner/lora.py)."""
    if has_adapters(module):
        return adapter_parameters(module)
    return dict(module.named_parameters())


def weight_manifest(module) -> Manifest:
    """(name, full shape, dtype) of every parameter a sync sends, in send order. Local."""
    return _manifest(synced_parameters(module))


def _manifest(params: dict[str, torch.nn.Parameter]) -> Manifest:
    return [
        (name, tuple(getattr(p, "ds_shape", p.shape)), str(p.dtype).removeprefix("torch."))
        for name, p in params.items()
    ]


def _parameter_buckets(
    params: dict[str, torch.nn.Parameter], buckets: list[Manifest]
) -> Iterator[tuple[Manifest, list[torch.nn.Parameter]]]:
    for bucket in buckets:
        yield bucket, [params[name] for name, _, _ in bucket]


def shard_buckets(
    module, buckets: list[Manifest], rank: int, world: int, checksums: Checksums
) -> Iterator[torch.Tensor]:
    """This rank's partition of each of `buckets` as one flat tensor: no gather and no
    collective; each parameter's share of its checksum goes into `checksums` as its bucket
    is laid out. ZeRO-3 keeps in `param.ds_tensor` elements [r*s, (r+1)*s) of the
    flattened parameter on rank r, with s = ceil(numel / world) and zeros past the end; the
    optimizer step writes the new values there, so it is current between steps even where a
    full copy of the parameter is kept (persistent parameters)."""
    for bucket, params in _parameter_buckets(synced_parameters(module), buckets):
        flat = joined([p.ds_tensor.detach() for p in params])
        checksums.update(shard_checksums(flat, bucket, rank, world))
        yield flat


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
    module, is_source: bool, buckets: list[Manifest]
) -> Iterator[tuple[Manifest, torch.Tensor | None]]:
    """Each bucket gathered and laid into one flat tensor on the source rank (None on the
    others, which must run the generator to the end: the gathers are collective); the next
    bucket is gathered only when the consumer asks for it."""
    import deepspeed

    for bucket, params in _parameter_buckets(synced_parameters(module), buckets):
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            flat = torch.cat([p.detach().reshape(-1) for p in params]) if is_source else None
        yield bucket, flat


def weight_buckets(
    module, is_source: bool, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Every full parameter, one bucket of whole layers at a time, as CPU copies on the source
    rank; the other ranks yield nothing but must run the generator to the end (the gathers
    are collective). The next bucket is gathered only when the consumer asks for it."""
    import deepspeed

    every = dict(module.named_parameters())
    buckets = bucket_manifest(_manifest(every), bucket_bytes)
    for bucket, params in _parameter_buckets(every, buckets):
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            copies = [
                (name, p.detach().to("cpu", copy=True))
                for (name, _, _), p in zip(bucket, params, strict=True)
                if is_source
            ]
        if is_source:
            yield copies


def broadcast_weights(module, group: Broadcaster | None, buckets: list[Manifest]) -> Checksums:
    """Gather bucket after bucket; where `group` is given (the source rank), send each one as
    a single flat tensor while the next one is gathered. Returns the checksums of what the
    source sent (none elsewhere)."""
    checksums: Checksums = {}
    in_flight: tuple[torch.Tensor, PendingTransfer] | None = None
    for bucket, flat in flat_buckets(module, group is not None, buckets):
        if in_flight is not None:
            in_flight[1].wait()
        if group is not None:
            in_flight = (flat, group.start_broadcast(flat))
            checksums.update(shard_checksums(flat, bucket, 0, 1))
    if in_flight is not None:
        in_flight[1].wait()
    return checksums


def save_pretrained(module, is_source: bool, path: str, merged: bool = False) -> None:
    """The current policy in Hugging Face format, written by the source rank, gathered bucket
    by bucket. With LoRA: the adapter in PEFT's format, and with `merged` the model with the
    adapter merged into its weights in `path`/merged."""
    if has_adapters(module):
        save_adapter(module, is_source, path)
        if merged:
            _save_model(module, is_source, f"{path}/{MERGED_DIR}")
    else:
        _save_model(module, is_source, path)


def _save_model(module, is_source: bool, path: str) -> None:
    buckets = weight_buckets(module, is_source)
    if has_adapters(module):
        weights = [pair for bucket in buckets for pair in merged_weights(module, bucket)]
        base = module.get_base_model()
    else:
        weights = [pair for bucket in buckets for pair in bucket]
        base = module
    if is_source:
        base.save_pretrained(path, state_dict=dict(weights))
