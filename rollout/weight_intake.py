"""An engine's side of a weight sync: the buckets (groupflow/core/weight_format.py) as they arrive,
by either transport, turned into the (name, tensor) pairs one vLLM load consumes
(rollout/engine.py `RolloutEngine.load_weights`), and the checksum of each pair as it is
handed to vLLM.

No Ray in here: the object-store path is given the functions that take the next bucket's
references and fetch them (actors/transport_object_store.py passes its queue and `ray.get`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from groupflow.core.errors import first_line
from groupflow.core.weight_format import (
    Broadcaster,
    Checksums,
    Manifest,
    bytes_tensor,
    checksum,
    unpack_bucket,
)

NamedTensors = Iterator[tuple[str, torch.Tensor]]


class StreamBroken(RuntimeError):
    """The learner's side of a streamed sync failed part-way: the learner's failure to
    report, not the engine's."""


def broken_stream(err: BaseException | None) -> StreamBroken | None:
    """The StreamBroken behind `err`, if any (vLLM may wrap what the pairs' iterator raised)."""
    while err is not None and not isinstance(err, StreamBroken):
        err = err.__cause__ or err.__context__
    return err


def streamed(
    buckets: list[Manifest],
    next_refs: Callable[[], Sequence[Any] | None],
    fetch: Callable[[Sequence[Any]], list],
    device: str,
) -> NamedTensors:
    """The pairs of `buckets` sent through an object store as the ranks' partitions: for each
    bucket, `next_refs()` blocks until the references to its partitions (in rank order) are in,
    or returns None where a rank's stream ended early; `fetch` turns them into byte arrays.
    One bucket is fetched at a time. Raises StreamBroken if the stream breaks."""
    for bucket in buckets:
        try:
            refs = next_refs()
            if refs is None:
                raise RuntimeError("a rank's stream ended early")
            arrays = fetch(refs)
        except Exception as err:
            raise StreamBroken(first_line(err)) from err
        dtype = getattr(torch, bucket[0][2])
        # Put together where the engine computes: on a GPU, each partition crosses once and
        # the parameters are cut and joined there, not by the host.
        shards = [bytes_tensor(a).view(dtype).to(device) for a in arrays]
        yield from unpack_bucket(shards, bucket)


def broadcast(group: Broadcaster, buckets: list[Manifest], device: str) -> NamedTensors:
    """The pairs of `buckets` received from the weight group's rank 0 as each bucket lands,
    the next one in transfer meanwhile."""

    def start(bucket: Manifest):
        numel = sum(torch.Size(shape).numel() for _, shape, _ in bucket)
        flat = torch.empty(numel, dtype=getattr(torch, bucket[0][2]), device=device)
        return flat, group.start_broadcast(flat)

    pending = start(buckets[0]) if buckets else None
    for k, bucket in enumerate(buckets):
        flat, transfer = pending
        transfer.wait()
        pending = start(buckets[k + 1]) if k + 1 < len(buckets) else None
        yield from unpack_bucket([flat], bucket)


def checksummed(named_tensors: Iterable[tuple[str, torch.Tensor]], into: Checksums) -> NamedTensors:
    """`named_tensors` passed on, each tensor's checksum put in `into` before vLLM reads it:
    the bytes the engine loads, after every transport and reassembly step."""
    for name, tensor in named_tensors:
        into[name] = checksum(tensor)
        yield name, tensor
