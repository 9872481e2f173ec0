"""A sync's shards from the engine's process to its tensor-parallel workers, each worker's
part of each tensor only (rollout/tp_shards.py), as the sync arrives.

vLLM's workers are processes of their own, and its calls into them (`collective_rpc`) send
every worker the same message: a sync passed that way reaches each worker whole. Here each
worker instead connects to a Unix socket of the engine's process for the length of one load,
and reads from it its own parts, one tensor at a time, while vLLM loads them: a worker holds at
most the part of the model it serves, never the whole. Each side checksums every part
(groupflow/core/weight_format.py), so the engine can tell that each worker loaded what it
was sent.

Frame: a 4-byte length, a JSON header (name, whole shape, dtype, the split or null for a tensor
sent whole), then the part's bytes; a zero length ends the stream.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from groupflow.core.weight_format import Checksums, checksum
from groupflow.rollout.tp_shards import ShardOfTensor, Split

_LENGTH = struct.Struct("!I")
Plan = Callable[[str, tuple[int, ...]], list[Split] | None]


class ShardSender:
    """The engine's side: a socket the workers connect to, then every part sent to its worker."""

    def __init__(self, workers: int):
        self.workers = workers
        self._dir = tempfile.TemporaryDirectory(prefix="groupflow-shards-")  # this user's only
        self.address = str(Path(self._dir.name) / "socket")
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.address)
        self._server.listen(workers)
        self._server.settimeout(0.5)
        self._peers: list[socket.socket] = []
        self.sent: list[Checksums] = [{} for _ in range(workers)]  # by worker rank

    def accept(self, loading: Callable[[], bool]) -> None:
        """Wait for every worker's connection, while `loading()` (the workers' load call has
        not ended: one that failed before it connected never will)."""
        by_rank: dict[int, socket.socket] = {}
        while len(by_rank) < self.workers:
            try:
                peer, _ = self._server.accept()
            except TimeoutError:
                if not loading():
                    raise ConnectionError(
                        "a tensor-parallel worker ended its load unconnected"
                    ) from None
                continue
            peer.settimeout(None)
            (rank,) = _LENGTH.unpack(_read(peer, _LENGTH.size))
            by_rank[rank] = peer
        self._peers = [by_rank[r] for r in range(self.workers)]

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], plan: Plan) -> None:
        """Each tensor's part to each worker (the whole where `plan` splits it not), the
        checksum of each part in `sent`, then the end of the stream."""
        for name, tensor in named_tensors:
            shape = tuple(tensor.shape)
            splits = plan(name, shape) or [None] * self.workers
            for rank, (peer, split) in enumerate(zip(self._peers, splits, strict=True)):
                part = tensor if split is None else split.of(tensor).contiguous()
                self.sent[rank][name] = checksum(part)
                header = json.dumps(
                    [name, shape, str(part.dtype).removeprefix("torch."), split and vars(split)]
                ).encode()
                peer.sendall(_LENGTH.pack(len(header)) + header)
                if part.numel():
                    peer.sendall(part.cpu().reshape(-1).view(torch.uint8).numpy())
        for peer in self._peers:
            peer.sendall(_LENGTH.pack(0))

    def close(self) -> None:
        """Close every connection (a worker still reading sees its stream end and fails its
        load) and remove the socket."""
        for peer in self._peers:
            peer.close()
        self._server.close()
        self._dir.cleanup()

    def __enter__(self) -> ShardSender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ShardStream:
    """A worker's side: its parts, read from the engine's socket as vLLM consumes them."""

    def __init__(self, address: str, rank: int):
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(address)
        self._sock.sendall(_LENGTH.pack(rank))
        self.received: Checksums = {}  # each part's checksum as it arrived
        self.bytes = 0  # the bytes of every part received

    def pairs(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for vLLM's loaders: a part as a ShardOfTensor, a whole tensor as is."""
        while True:
            (length,) = _LENGTH.unpack(_read(self._sock, _LENGTH.size))
            if not length:
                return
            name, shape, dtype, split = json.loads(_read(self._sock, length))
            split = split and Split(**split)
            part_shape = list(shape)
            if split is not None:
                part_shape[split.dim] = split.length
            part = torch.empty(part_shape, dtype=getattr(torch, dtype))
            if part.numel():
                _read_into(self._sock, part.reshape(-1).view(torch.uint8).numpy())
            self.received[name] = checksum(part)
            self.bytes += part.numel() * part.element_size()
            yield name, part if split is None else ShardOfTensor(part, name, tuple(shape), split)

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> ShardStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read(sock: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    _read_into(sock, memoryview(buffer))
    return bytes(buffer)


def _read_into(sock: socket.socket, buffer) -> None:
    view, done = memoryview(buffer).cast("B"), 0
    while done < len(view):
        got = sock.recv_into(view[done:])
        if not got:
            raise ConnectionError("the engine's shard stream ended part-way")
        done += got


class ResidentPeak:
    """The most resident memory (Linux) a process held in a block above what it held at the
    block's start (`extra`: the most of any of `pids`, this process by default), sampled every
    millisecond by a thread of its own."""

    def __init__(self, pids: tuple[int | str, ...] = ("self",)):
        self.pids = pids

    def __enter__(self) -> ResidentPeak:
        self.base = [_resident_bytes(pid) for pid in self.pids]
        self.peak = list(self.base)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while True:
            self.peak = [
                max(p, _resident_bytes(pid)) for p, pid in zip(self.peak, self.pids, strict=True)
            ]
            if self._stop.wait(0.001):
                return

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def extra(self) -> int:
        return max(p - b for p, b in zip(self.peak, self.base, strict=True))


def _resident_bytes(pid: int | str) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
