"""Weight sync in buckets (groupflow/core/weight_format.py, learner/weight_export.py,
rollout/weight_intake.py): how a model is cut, the checksums that verify a load, and a round
trip through a real gloo weight group between two threads."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from groupflow.actors.transport_collective import open_weight_group
from groupflow.core import weight_format
from groupflow.core.errors import expected_failure
from groupflow.core.random_model import random_causal_lm
from groupflow.core.weight_format import (
    LoadedWeights,
    WeightSyncMismatch,
    WorkerLoad,
    add_checksums,
    bucket_manifest,
    bytes_tensor,
    check_loaded,
    checksum,
    layer_of,
    shard_checksums,
    unpack_bucket,
)
from groupflow.learner.weight_export import (
    broadcast_weights,
    joined,
    shard_buckets,
    weight_manifest,
)
from groupflow.rollout.engine import RolloutEngine
from groupflow.rollout.shard_stream import ShardStream
from groupflow.rollout.tp_shards import ModelShape, shard_plan
from groupflow.rollout.weight_intake import broadcast


def random_manifest(gen: torch.Generator) -> list[tuple[str, tuple[int, ...], str]]:
    """Embedding, numbered layers of several parameters (one in float64), norm and head."""
    out = [
        (
            "model.embed_tokens.weight",
            (int(torch.randint(50, 400, (), generator=gen)), 8),
            "float32",
        )
    ]
    for layer in range(int(torch.randint(1, 9, (), generator=gen))):
        for part in ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj"):
            rows = int(torch.randint(1, 60, (), generator=gen))
            dtype = "float64" if part == "o_proj" and layer == 2 else "float32"
            out.append((f"model.layers.{layer}.{part}.weight", (rows, 8), dtype))
    out += [("model.norm.weight", (8,), "float32"), ("lm_head.weight", (300, 8), "float32")]
    return out


def nbytes(entry) -> int:
    return (
        torch.Size(entry[1]).numel()
        * torch.empty((), dtype=getattr(torch, entry[2])).element_size()
    )


@pytest.mark.parametrize("repeat", range(5))
def test_buckets_keep_order_whole_layers_and_the_size(gen, repeat):
    manifest = random_manifest(gen)
    limit = int(torch.randint(100, 20_000, (), generator=gen))
    buckets = bucket_manifest(manifest, limit)
    assert [e for b in buckets for e in b] == manifest
    seen: dict[str, int] = {}
    for k, bucket in enumerate(buckets):
        assert len({e[2] for e in bucket}) == 1, "one dtype per bucket (one flat tensor)"
        layers = {layer_of(e[0]) for e in bucket}
        for layer in layers:
            assert seen.setdefault(layer, k) == k or bucket_dtype_split(manifest, layer)
        if sum(nbytes(e) for e in bucket) > limit:
            assert len(layers) == 1, "only a single layer may exceed the bucket size"


def bucket_dtype_split(manifest, layer: str) -> bool:
    """A layer is split only where its own dtype changes."""
    return len({e[2] for e in manifest if layer_of(e[0]) == layer}) > 1


def zero3_partitions(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    """ZeRO-3's layout of a parameter over `world` ranks (what `param.ds_tensor` holds on each):
    flattened, zero-padded to a multiple of `world`, cut into `world` equal slices."""
    flat = t.reshape(-1)
    padded = torch.cat([flat, flat.new_zeros(-flat.numel() % world)])
    return list(padded.chunk(world))


def as_transported(t: torch.Tensor, dtype: str) -> torch.Tensor:
    """A flat tensor as an engine reads it: bytes in a numpy array, viewed as `dtype`."""
    return bytes_tensor(t.view(torch.uint8).numpy()).view(getattr(torch, dtype))


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_the_ranks_partitions_put_every_parameter_back_exactly(gen, world):
    manifest = random_manifest(gen)
    weights = {
        name: torch.randn(shape, dtype=getattr(torch, dtype), generator=gen)
        for name, shape, dtype in manifest
    }
    buckets = bucket_manifest(manifest, int(torch.randint(100, 20_000, (), generator=gen)))
    got = []
    for bucket in buckets:
        per_param = [zero3_partitions(weights[name], world) for name, _, _ in bucket]
        shards = [torch.cat([parts[r] for parts in per_param]) for r in range(world)]
        got += unpack_bucket([as_transported(s, bucket[0][2]) for s in shards], bucket)
    assert [n for n, _ in got] == [e[0] for e in manifest]
    for name, tensor in got:
        assert tensor.dtype == weights[name].dtype and torch.equal(tensor, weights[name]), name


class Zero3Rank:
    """What `shard_buckets` reads of a ZeRO-3 module on one rank: parameters in order, each
    with its full shape (`ds_shape`) and this rank's partition (`ds_tensor`)."""

    def __init__(self, weights: dict[str, torch.Tensor], world: int, rank: int, flat: bool):
        parts = {name: zero3_partitions(w, world)[rank] for name, w in weights.items()}
        if flat:  # DeepSpeed's layout: the rank's partitions back to back, a buffer per dtype
            for dtype in {p.dtype for p in parts.values()}:
                names = [n for n, p in parts.items() if p.dtype == dtype]
                buffer = torch.cat([parts[n] for n in names])
                parts.update(
                    zip(names, buffer.split([parts[n].numel() for n in names]), strict=True)
                )
        else:  # each partition in memory of its own
            parts = {name: p.clone() for name, p in parts.items()}
        self.params = []
        for name, w in weights.items():
            param = torch.nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)
            param.ds_shape, param.ds_tensor = w.shape, parts[name]
            self.params.append((name, param))

    def named_parameters(self):
        return iter(self.params)


@pytest.mark.parametrize("flat", [True, False], ids=["one-buffer", "scattered"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_shard_buckets_round_trip_and_copy_nothing_from_one_buffer(gen, world, flat):
    manifest = random_manifest(gen)
    weights = {
        name: torch.randn(shape, dtype=getattr(torch, dtype), generator=gen)
        for name, shape, dtype in manifest
    }
    limit = int(torch.randint(100, 20_000, (), generator=gen))
    ranks = [Zero3Rank(weights, world, r, flat) for r in range(world)]
    assert weight_manifest(ranks[0]) == manifest
    buckets = bucket_manifest(manifest, limit)
    shares = [{} for _ in ranks]
    streams = [
        list(shard_buckets(rank, buckets, r, world, shares[r])) for r, rank in enumerate(ranks)
    ]
    buffers = {p.ds_tensor.untyped_storage().data_ptr() for _, p in ranks[0].params}
    for bucket, shard in zip(buckets, streams[0], strict=True):
        # a view of the partitions' own memory where they lie back to back, else a copy
        viewed = shard.untyped_storage().data_ptr() in buffers
        assert viewed == (flat or len(bucket) == 1)
    got = []
    for bucket, shards in zip(buckets, zip(*streams, strict=True), strict=True):
        got += unpack_bucket([as_transported(s, bucket[0][2]) for s in shards], bucket)
    assert [n for n, _ in got] == [e[0] for e in manifest]
    for name, tensor in got:
        assert tensor.dtype == weights[name].dtype and torch.equal(tensor, weights[name]), name
    # the ranks' checksum shares, taken as each bucket was laid out, add up to the whole's
    assert add_checksums(shares) == {name: checksum(w) for name, w in weights.items()}


def test_joined_views_only_tensors_back_to_back(gen):
    buffer = torch.randn(100, dtype=torch.float64, generator=gen)
    back_to_back = [buffer[0:12].view(3, 4), buffer[12:40], buffer[40:41]]
    view = joined(back_to_back)
    assert view.data_ptr() == buffer.data_ptr() and torch.equal(view, buffer[:41])
    for tensors in (
        [buffer[0:12], buffer[13:40]],  # a gap
        [buffer[12:40], buffer[0:12]],  # out of order
        [buffer[0:12], torch.randn(5, dtype=torch.float64, generator=gen)],  # another buffer
        [buffer[0:20:2], buffer[20:30]],  # not contiguous
    ):
        copy = joined(tensors)
        assert copy.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
        assert torch.equal(copy, torch.cat([t.reshape(-1) for t in tensors]))


def test_a_partition_of_the_wrong_size_is_refused(gen):
    bucket = [
        ("model.layers.0.q_proj.weight", (7, 3), "float32"),
        ("model.norm.weight", (5,), "float32"),
    ]
    # two ranks: ceil(21 / 2) + ceil(5 / 2) = 14 elements each
    with pytest.raises(ValueError, match=r"shard 1 of 2 holds 13 elements, the manifest 14"):
        list(unpack_bucket([torch.zeros(14), torch.zeros(13)], bucket))


def test_layer_of_names_the_unit_vllm_loads_whole():
    assert layer_of("model.layers.12.self_attn.q_proj.weight") == "model.layers.12"
    assert layer_of("model.embed_tokens.weight") == "model.embed_tokens"
    assert layer_of("lm_head.weight") == "lm_head"


class RecordingLLM:
    """vLLM's side of a load, recorded: the pairs consumed as its worker consumes them (one
    pass, as they arrive); with `workers` > 1, each tensor-parallel worker's, read from the
    engine's shard stream by a thread of its own as by a process (rollout/weight_receiver.py
    `load_shards`), `corrupt` changing what a worker says it received of a tensor."""

    def __init__(self, workers: int = 1, corrupt: tuple[int, str] | None = None):
        self.workers, self.corrupt = workers, corrupt
        self.loads: list[list[list[tuple[str, torch.Tensor]]]] = []  # [load][worker] pairs
        self.llm_engine = self  # the engine core's calls, recorded here too
        self.after_load: list[tuple] = []

    def collective_rpc(self, method, args):
        assert method == ("load_named_tensors" if self.workers == 1 else "load_shards")
        if self.workers == 1:
            (named,) = args
            self.loads.append([[(n, t.clone()) for n, t in named]])
            return None
        (address,) = args
        got, results = [None] * self.workers, [None] * self.workers

        def worker(rank: int) -> None:
            with ShardStream(address, rank) as stream:
                got[rank] = [(n, getattr(t, "part", t).clone()) for n, t in stream.pairs()]
            if self.corrupt is not None and self.corrupt[0] == rank:
                stream.received[self.corrupt[1]] = (0, 0)
            results[rank] = (WorkerLoad(rank, stream.bytes, 0), stream.received)

        threads = [threading.Thread(target=worker, args=(r,)) for r in range(self.workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        self.loads.append(got)
        return results

    def set_weight_version(self, version: str):
        self.after_load.append(("version", version))

    def reset_prefix_cache(self, reset_running_requests: bool = False):
        self.after_load.append(("reset", reset_running_requests))


class RecordingEngine:
    """The engine's receiving and loading steps, over a recording stand-in for vLLM."""

    load_weights = RolloutEngine.load_weights
    _load_by_shard = RolloutEngine._load_by_shard

    def __init__(self, tensor_parallel_size: int = 1, corrupt: tuple[int, str] | None = None):
        self.llm = RecordingLLM(tensor_parallel_size, corrupt)
        self.policy_version = 0
        self.tensor_parallel_size = tensor_parallel_size
        self.model_shape = ModelShape(num_key_value_heads=2, vocab_size=96)
        self.lora = None  # the whole model

    def receive_weights(self, group, buckets, version: int, device: str):
        """The collective transport's engine side (actors/transport_collective.py `receive`):
        the buckets received as each lands and loaded in one pass."""
        return self.load_weights(broadcast(group, buckets, device), version)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_buckets_reach_the_engines_exactly_in_one_load(gen):
    model = random_causal_lm(
        96,
        seed=int(torch.randint(0, 2**31, (), generator=gen)),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    manifest = weight_manifest(model)
    bucket_bytes = 40_000  # about a layer: several buckets
    buckets = bucket_manifest(manifest, bucket_bytes)
    assert len(buckets) > 3

    # the second engine tensor-parallel: each of its workers reads its own parts alone
    port, engines = free_port(), [RecordingEngine(), RecordingEngine(tensor_parallel_size=2)]
    errors: list[BaseException] = []
    sent, loaded = {}, {}

    def member(rank: int) -> None:
        try:
            group = open_weight_group("127.0.0.1", port, rank, 3, "gloo")
            if rank == 0:
                sent.update(broadcast_weights(model, group, buckets))
            else:
                loaded[rank] = engines[rank - 1].receive_weights(group, buckets, 7, "cpu")
        except BaseException as err:  # re-raised in the test's thread
            errors.append(err)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    want = dict(model.named_parameters())
    assert sent == {name: checksum(p) for name, p in want.items()}
    for rank, engine in enumerate(engines, start=1):
        assert len(engine.llm.loads) == 1, "one load per sync, fed as the buckets arrive"
        # the tokens after it labelled with its version; no cache of the old weights used
        assert engine.llm.after_load == [("version", "7"), ("reset", True)]
        assert engine.policy_version == loaded[rank].version == 7
        check_loaded(sent, loaded[rank], f"engine {rank}")
        tp = engine.tensor_parallel_size
        assert [w.rank for w in loaded[rank].workers] == ([0, 1] if tp > 1 else [])
        for worker, got in enumerate(engine.llm.loads[0]):
            assert [n for n, _ in got] == [e[0] for e in manifest]
            for name, tensor in got:
                whole = want[name].detach()
                splits = shard_plan(name, tuple(whole.shape), engine.model_shape, tp)
                assert torch.equal(tensor, whole if splits is None else splits[worker].of(whole))
            if tp > 1:  # half of every projection, the embedding's rows: not the whole model
                held = sum(t.numel() for _, t in got)
                assert held < 0.6 * sum(p.numel() for p in want.values())
                assert loaded[rank].workers[worker].received_bytes == 4 * held


def test_a_tensor_parallel_worker_that_received_other_bytes_stops_the_load(gen):
    model = random_causal_lm(96, seed=3, hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    name = "model.layers.0.mlp.down_proj.weight"
    engine = RecordingEngine(tensor_parallel_size=2, corrupt=(1, name))
    with pytest.raises(
        WeightSyncMismatch,
        match=f"^weight sync 4: tensor-parallel worker 1 received other bytes of {name} ",
    ):
        engine.load_weights(((n, p.detach()) for n, p in model.named_parameters()), 4)


# ----- checksums --------------------------------------------------------------------------------
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def reference_checksum(t: torch.Tensor, start: int) -> tuple[int, int]:
    """The definition, in Python integers, over a tensor's bytes: little-endian 64-bit words,
    counted from byte `start * element size` of the whole, summed plain and weighted by
    their position, modulo 2^64."""
    size = t.element_size()
    data = bytes(t.reshape(-1).view(torch.uint8).tolist())
    padded = bytes(start * size % 8) + data + bytes(-(start * size + len(data)) % 8)
    first = start * size // 8
    words = [int.from_bytes(padded[i : i + 8], "little") for i in range(0, len(padded), 8)]
    total = sum(words)
    weighted = sum((first + i) * w for i, w in enumerate(words))
    return total % 2**64, weighted % 2**64


def random_tensor(gen: torch.Generator, dtype: torch.dtype, numel: int) -> torch.Tensor:
    # wide exponents and both signs, so that high bits and the sign bit are exercised
    t = torch.randn(numel, dtype=torch.float64, generator=gen)
    t = t * torch.exp2(torch.randint(-60, 60, (numel,), generator=gen).double())
    return t.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("row", [3, 1024], ids=["many-rows", "one-row"])
def test_checksum_is_the_exact_sums_of_the_words(gen, dtype, row, monkeypatch):
    monkeypatch.setattr(weight_format, "_ROW", row)
    for _ in range(5):
        numel = int(torch.randint(1, 200, (), generator=gen))
        # a view at an odd place in memory too, as a partition inside a bucket lies
        lead = int(torch.randint(0, 3, (), generator=gen))
        t = random_tensor(gen, dtype, numel + lead)[lead:].reshape(-1, 1)
        start = int(torch.randint(0, 2**40, (), generator=gen))
        assert checksum(t, start) == reference_checksum(t, start)
    # the int64 sums wrap around: still exact modulo 2^64 where every word is near 2^63
    big = torch.full((numel,), -(2**63) + 5, dtype=torch.int64).view(torch.float64)
    assert checksum(big, start) == reference_checksum(big, start)


@pytest.mark.parametrize("small, batch", [(1 << 17, 1 << 20), (6, 40)], ids=["default", "tiny"])
def test_many_checksums_at_once_are_each_tensors_own(gen, small, batch, monkeypatch):
    """`checksums` sums small whole-word tensors a batch at a time: the same numbers as the
    definition, for tensors on whole words or not, batched or not, split over batches."""
    monkeypatch.setattr(weight_format, "_SMALL_WORDS", small)
    monkeypatch.setattr(weight_format, "_BATCH_WORDS", batch)
    parts = []
    for i in range(40):
        dtype = DTYPES[int(torch.randint(0, len(DTYPES), (), generator=gen))]
        numel = int(torch.randint(1, 120, (), generator=gen))
        lead = int(torch.randint(0, 3, (), generator=gen))
        t = random_tensor(gen, dtype, numel + lead)[lead:]
        start = int(torch.randint(0, 2**40, (), generator=gen)) * int(
            torch.randint(1, 3, (), generator=gen)
        )
        parts.append((f"t{i}", t, start))
    near_wrap = torch.full((16,), -(2**63) + 5, dtype=torch.int64).view(torch.float64)
    parts.append(("wrap", near_wrap, 8))
    got = weight_format.checksums(parts)
    assert got == {name: reference_checksum(t, start) for name, t, start in parts}


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_single_flipped_bit_anywhere_changes_the_checksum(gen, dtype):
    t = random_tensor(gen, dtype, 300)
    before = checksum(t)
    for bit in range(t.element_size() * 8):
        i = int(torch.randint(0, t.numel(), (), generator=gen))
        flipped = t.clone()
        flipped.view(torch.uint8)[i * t.element_size() + bit // 8] ^= 1 << (bit % 8)
        assert checksum(flipped) != before, (bit, i)


def test_moved_elements_change_the_weighted_sum(gen):
    t = random_tensor(gen, torch.float32, 100)
    swapped = t.clone()
    swapped[[2, 70]] = t[[70, 2]]  # the low halves of two words: the plain sum stays
    assert checksum(swapped)[0] == checksum(t)[0] and checksum(swapped) != checksum(t)
    assert checksum(t.roll(1)) != checksum(t)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_the_ranks_shares_add_up_to_each_tensors_checksum_over_chunked_buckets(gen, world):
    manifest = random_manifest(gen)
    weights = {
        name: random_tensor(gen, getattr(torch, dtype), torch.Size(shape).numel()).view(shape)
        for name, shape, dtype in manifest
    }
    buckets = bucket_manifest(manifest, int(torch.randint(100, 5_000, (), generator=gen)))
    assert len(buckets) > 1
    shares = [{} for _ in range(world)]
    for bucket in buckets:
        per_param = [zero3_partitions(weights[name], world) for name, _, _ in bucket]
        for r in range(world):
            shard = torch.cat([parts[r] for parts in per_param])
            shares[r].update(shard_checksums(shard, bucket, r, world))
    assert add_checksums(shares) == {n: reference_checksum(w, 0) for n, w in weights.items()}


def test_a_load_that_differs_is_one_line_naming_engine_version_and_tensor(gen):
    a, b = random_tensor(gen, torch.float32, 50), random_tensor(gen, torch.float32, 20)
    sent = {"model.layers.0.q.weight": checksum(a), "model.norm.weight": checksum(b)}
    check_loaded(sent, LoadedWeights(4, dict(sent)), "engine 0")  # the same: passes
    corrupt = b.clone()
    corrupt.view(torch.int32)[7] ^= 1 << 12
    cases = {
        "loaded checksum": {**sent, "model.norm.weight": checksum(corrupt)},
        "did not load it": {"model.layers.0.q.weight": checksum(a)},
        "did not send": {**sent, "lm_head.weight": checksum(a)},
    }
    for what, loaded in cases.items():
        with pytest.raises(WeightSyncMismatch) as err:
            check_loaded(sent, LoadedWeights(4, loaded), "engine 1 (actor 12ab)")
        message = str(err.value)
        assert "\n" not in message and what in message
        assert message.startswith("weight sync of policy version 4: engine 1 (actor 12ab): tensor")
        name = "lm_head.weight" if what == "did not send" else "model.norm.weight"
        assert f"tensor {name}:" in message
        # the command line ends with this line and exit 1 (groupflow/core/errors.py)
        assert expected_failure(err.value) == (message, 1)


def test_the_engine_side_imports_nothing_of_the_learner():
    """The wire format is neutral: the engines' code reaches the learner's through it only."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    files = [*sorted((root / "rollout").glob("*.py")), root / "actors" / "generator.py"]
    assert len(files) > 3
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                assert not name.startswith(("groupflow.learner", "learner")), (path.name, name)
