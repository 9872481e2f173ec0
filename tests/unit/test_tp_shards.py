"""Tensor-parallel loads by shard (rollout/tp_shards.py, rollout/shard_stream.py): a worker's
part of each tensor, handed to vLLM's own weight loaders, fills its parameters exactly as the
whole tensor does; the parts travel to each worker alone, checksummed on both sides."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from groupflow.rollout.shard_stream import ResidentPeak, ShardSender, ShardStream
from groupflow.rollout.tp_shards import ModelShape, ShardOfTensor, Split, shard_plan

HIDDEN, HEAD, HEADS, INTER, VOCAB = 32, 4, 8, 48, 100


@pytest.fixture
def worker_rank(monkeypatch):
    """vLLM's parameters and embedding as worker `rank` of `tp` builds them (pure layout logic:
    no process group)."""
    import vllm.model_executor.layers.vocab_parallel_embedding as vocab
    import vllm.model_executor.parameter as parameter

    def as_rank(rank: int, tp: int) -> None:
        for module in (vocab, parameter):
            monkeypatch.setattr(module, "get_tensor_model_parallel_rank", lambda: rank)
            monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: tp)

    return as_rank


def _param(shape, input_dim=1):
    from vllm.model_executor.parameter import ModelWeightParameter

    data = torch.full(shape, float("nan"))
    return ModelWeightParameter(data=data, input_dim=input_dim, output_dim=0, weight_loader=None)


def _loaded(name, whole, model, rank, tp):
    """What vLLM's loaders receive for `name` on worker `rank`: its part, posing as the whole."""
    splits = shard_plan(name, tuple(whole.shape), model, tp)
    return ShardOfTensor(splits[rank].of(whole).clone(), name, tuple(whole.shape), splits[rank])


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_a_workers_parts_load_as_the_whole_tensors_do_in_vllms_loaders(worker_rank, tp, kv_heads):
    """q/k/v (key/value heads replicated when fewer than workers), gate/up, o/down and the
    padded vocabulary: each worker's parameters, loaded by vLLM's loaders from the whole
    tensors and from the parts the plan cuts, are equal."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    torch.manual_seed(0)
    model = ModelShape(num_key_value_heads=kv_heads, vocab_size=VOCAB)
    prefix = "model.layers.0"
    whole = {
        f"{prefix}.self_attn.q_proj.weight": torch.randn(HEADS * HEAD, HIDDEN),
        f"{prefix}.self_attn.k_proj.weight": torch.randn(kv_heads * HEAD, HIDDEN),
        f"{prefix}.self_attn.v_proj.weight": torch.randn(kv_heads * HEAD, HIDDEN),
        f"{prefix}.self_attn.o_proj.weight": torch.randn(HIDDEN, HEADS * HEAD),
        f"{prefix}.mlp.gate_proj.weight": torch.randn(INTER, HIDDEN),
        f"{prefix}.mlp.up_proj.weight": torch.randn(INTER, HIDDEN),
        f"{prefix}.mlp.down_proj.weight": torch.randn(HIDDEN, INTER),
        "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN),
    }
    heads, kv = HEADS // tp, max(kv_heads // tp, 1)
    replicas = max(tp // kv_heads, 1)
    for rank in range(tp):
        worker_rank(rank, tp)
        filled = []
        for source in ("whole", "part"):

            def get(name, source=source, rank=rank):
                full = whole[f"{prefix}.{name}" if "embed" not in name else name]
                if source == "whole":
                    return full
                key = f"{prefix}.{name}" if "embed" not in name else name
                return _loaded(key, full, model, rank, tp)

            qkv = _param(((heads + 2 * kv) * HEAD, HIDDEN))
            for shard_id, offset, size in [
                ("q", 0, heads * HEAD),
                ("k", heads * HEAD, kv * HEAD),
                ("v", (heads + kv) * HEAD, kv * HEAD),
            ]:
                qkv.load_qkv_weight(
                    get(f"self_attn.{shard_id}_proj.weight"),
                    shard_offset=offset,
                    shard_size=size,
                    shard_id=shard_id,
                    num_heads=replicas,
                )
            gate_up = _param((2 * INTER // tp, HIDDEN))
            for k, part in enumerate(("gate", "up")):
                gate_up.load_merged_column_weight(
                    get(f"mlp.{part}_proj.weight"),
                    shard_offset=k * INTER // tp,
                    shard_size=INTER // tp,
                )
            o_proj, down = _param((HIDDEN, HEADS * HEAD // tp)), _param((HIDDEN, INTER // tp))
            o_proj.load_row_parallel_weight(get("self_attn.o_proj.weight"))
            down.load_row_parallel_weight(get("mlp.down_proj.weight"))
            embedding = VocabParallelEmbedding(VOCAB, HIDDEN, params_dtype=torch.float32)
            embedding.weight.data.zero_()
            embedding.weight_loader(embedding.weight, get("model.embed_tokens.weight"))
            filled.append([qkv.data, gate_up.data, o_proj.data, down.data, embedding.weight.data])
        for by_whole, by_part in zip(*filled, strict=True):
            assert not by_whole.isnan().any()
            assert torch.equal(by_whole, by_part)


def test_replicated_tensors_go_whole_and_a_loader_narrowing_elsewhere_fails_naming_the_tensor():
    model = ModelShape(num_key_value_heads=2, vocab_size=VOCAB)
    for name in ("model.norm.weight", "model.layers.3.self_attn.o_proj.bias", "x.q_norm.weight"):
        assert shard_plan(name, (HIDDEN,), model, 2) is None
    assert shard_plan("model.layers.0.mlp.up_proj.weight", (INTER, HIDDEN), model, 1) is None
    name = "model.layers.0.mlp.down_proj.weight"
    split = shard_plan(name, (HIDDEN, INTER), model, 2)[1]
    assert split == Split(1, INTER // 2, INTER // 2)
    part = ShardOfTensor(torch.zeros(HIDDEN, INTER // 2), name, (HIDDEN, INTER), split)
    assert part.shape == (HIDDEN, INTER) and part.narrow(1, INTER // 2, INTER // 2).shape[1] == 24
    with pytest.raises(ValueError, match=f"^tensor-parallel load of {name}: "):
        part.narrow(1, 0, INTER // 2)  # worker 0's rows: not what this worker was sent


def _stream_to_workers(tensors, tp, model, broken=False):
    """`tensors` through a ShardSender to `tp` ShardStreams read in threads: what each read
    (or the error it met), and the sender. `broken`: the engine's side sends worker 0 half a
    frame and closes, as where the sync it passes on breaks."""
    sender = ShardSender(tp)
    got: list = [None] * tp

    def worker(rank):
        try:
            with ShardStream(sender.address, rank) as stream:
                got[rank] = ([(n, getattr(t, "part", t)) for n, t in stream.pairs()], stream)
        except ConnectionError as err:
            got[rank] = err

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    sender.accept(lambda: True)
    try:
        if broken:
            sender._peers[0].sendall(b"\0\0\0\x05{")
        else:
            sender.send(tensors.items(), lambda n, s: shard_plan(n, s, model, tp))
    finally:
        sender.close()
        for t in threads:
            t.join()
    return got, sender


def test_each_worker_reads_its_own_parts_alone_checksummed_on_both_sides():
    torch.manual_seed(1)
    model = ModelShape(num_key_value_heads=2, vocab_size=VOCAB)
    tensors = {
        "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN).to(torch.bfloat16),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(HIDDEN, HEADS * HEAD),
        "model.layers.0.input_layernorm.weight": torch.randn(HIDDEN),
    }
    got, sender = _stream_to_workers(tensors, 2, model)
    for rank, (pairs, stream) in enumerate(got):
        assert [n for n, _ in pairs] == list(tensors)
        for name, part in pairs:
            splits = shard_plan(name, tuple(tensors[name].shape), model, 2)
            want = tensors[name] if splits is None else splits[rank].of(tensors[name])
            assert part.dtype == want.dtype and torch.equal(part, want)
        assert stream.received == sender.sent[rank]  # the same bytes on both sides
        assert stream.bytes == sum(p.numel() * p.element_size() for _, p in pairs)
    # the vocabulary padded to 128 rows, cut in two: worker 1 holds rows 64-99
    assert [g[0][0][1].shape[0] for g in got] == [64, VOCAB - 64]


def test_a_stream_that_ends_part_way_fails_the_workers_read():
    model = ModelShape(num_key_value_heads=2, vocab_size=VOCAB)
    got, _ = _stream_to_workers({}, 2, model, broken=True)
    assert all(isinstance(g, ConnectionError) for g in got), got


def test_the_resident_peak_sees_memory_held_inside_the_block_only():
    with ResidentPeak() as held:
        block = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
        time.sleep(0.05)
        del block
    assert 60 << 20 < held.extra < 80 << 20
