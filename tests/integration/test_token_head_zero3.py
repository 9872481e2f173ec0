"""The token head under real DeepSpeed ZeRO-3 (world size 1, gloo, CPU accelerator): where the
head's weight is a partitioned parameter, gathered only around its module's forward and
backward, the statistics and gradients equal a plain torch model's full-logits path."""

from __future__ import annotations

import os
import socket

import pytest
import torch

from groupflow.core.random_model import random_causal_lm
from tests.unit.test_moe_blocks import TINY_MOE

pytestmark = pytest.mark.integration

VOCAB = 61


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_rank() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.update(
        DS_ACCELERATOR="cpu",
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
    )
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


def _model(seed: int, tied: bool):
    model = random_causal_lm(VOCAB, seed=seed, tie_word_embeddings=tied)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.config.use_cache = False
    return model


def _batch(gen: torch.Generator):
    from groupflow.learner.token_head import response_positions

    lengths = [int(torch.randint(3, 14, (1,), generator=gen)) for _ in range(5)]
    prompts = [int(torch.randint(1, n, (1,), generator=gen)) for n in lengths]
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    attention = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        ids[r, :n] = torch.randint(0, VOCAB, (n,), generator=gen)
        attention[r, :n] = 1
    return ids, attention, response_positions(ids, lengths, prompts)


def zero3_against_plain(seed: int, tied: bool, checkpointing: bool, path: str) -> dict:
    """Two optimizer steps side by side: the ZeRO-3 engine with the token head (and layer
    checkpointing), loaded the way a learner rank loads it, against a plain torch model with
    full logits. Runs in the rank process."""
    _init_rank()
    import deepspeed
    from deepspeed.utils import safe_get_full_grad
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from groupflow.config import LearnerConfig, Zero3Config
    from groupflow.learner.model_setup import prepare_model
    from groupflow.learner.token_head import response_positions, response_token_stats
    from groupflow.learner.token_stats import token_stats
    from groupflow.learner.zero_config import deepspeed_config

    # The tuning table keeps a small model's parameters whole at world size 1
    # (docs/zero3_tuning.md); this test is about a partitioned head, so it partitions all.
    cfg = LearnerConfig(
        gradient_checkpointing=checkpointing, zero3=Zero3Config(param_persistence_threshold=0)
    )
    plain = _model(seed, tied)
    plain.save_pretrained(path)
    nparams = sum(p.numel() for p in plain.parameters())
    ds_config = deepspeed_config(cfg, "float32", nparams, world_size=1)
    # Alive during from_pretrained: the weights load straight into ZeRO-3 partitions.
    hf_ds_config = HfDeepSpeedConfig(ds_config)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prepare_model(model, cfg)
    opt = cfg.optimizer
    # AdamW's first update is lr * g / (|g| + eps): with the default eps a gradient near eps
    # turns float32 last-bit differences (sums in another order) into different updates, and
    # the second step would compare two different models. A larger eps keeps the update a
    # smooth function of the gradient.
    adamw = dict(lr=0.01, betas=opt.betas, eps=1e-3)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), **adamw), config=ds_config
    )
    engine.train()
    plain_opt = torch.optim.AdamW(plain.parameters(), **adamw)
    gen = torch.Generator().manual_seed(seed)
    out: dict = {"stats": [], "grads": []}
    for _ in range(2):
        ids, attention, positions = _batch(gen)
        w = torch.randn(2, positions.rows.numel(), generator=gen)
        got = response_token_stats(engine, ids, attention, positions, 0.8, entropy_grad=True)
        logits = plain(input_ids=ids, attention_mask=attention).logits
        want = token_stats(
            logits[positions.rows, positions.cols], positions.targets, 0.8, entropy_grad=True
        )
        out["stats"].append(
            [(getattr(got, f).detach(), getattr(want, f).detach()) for f in ("logp", "entropy")]
        )
        engine.backward((w[0] * got.logp).sum() + (w[1] * got.entropy).sum())
        plain_opt.zero_grad()
        ((w[0] * want.logp).sum() + (w[1] * want.entropy).sum()).backward()
        got_grads = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}
        out["grads"].append(
            [(n, got_grads[n], p.grad.clone()) for n, p in plain.named_parameters()]
        )
        engine.step()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), cfg.optimizer.max_grad_norm)
        plain_opt.step()
    # An empty micro-batch still runs (ZeRO-3 ranks gather together): a forward on one token
    # and a zero loss whose backward reaches every parameter.
    ids = torch.zeros(1, 1, dtype=torch.long)
    empty = response_token_stats(
        engine, ids, torch.ones_like(ids), response_positions(ids, [], []), 1.0
    )
    engine.backward(empty.logp.sum() * 0.0)
    out["empty_grads"] = {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
    out["names"] = [n for n, _ in engine.module.named_parameters()]
    out["plain_names"] = [n for n, _ in plain.named_parameters()]
    engine.destroy()
    del hf_ds_config
    return out


@pytest.mark.parametrize(("tied", "checkpointing"), [(True, True), (False, False)])
def test_zero3_head_matches_plain_full_logits(rank_process, tmp_path, tied, checkpointing):
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    job = rank_process.submit(zero3_against_plain, seed, tied, checkpointing, str(tmp_path))
    out = job.result(timeout=300)
    assert out["names"] == out["plain_names"]
    for step in out["stats"]:
        for got, want in step:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for name, grad in out["empty_grads"].items():
        assert grad is not None and not grad.any(), name
    # The second step also checks the first update was the same. float32 gradients summed in
    # another order differ by up to 1.1e-5 of the largest gradient (110 seeds); a wrong head or
    # mask is off by the gradient's own size.
    for step in out["grads"]:
        for name, got, want in step:
            scale = want.abs().max().item()
            torch.testing.assert_close(got, want, rtol=0, atol=3e-5 * scale, msg=name)


def moe_block_gathers(leaf: bool, path: str) -> list[list[list[int]]]:
    """Per forward (two), per mixture-of-experts block: the number of its parameters each
    ZeRO-3 all-gather took, in order, counted in DeepSpeed's parameter coordinator (fetches
    and prefetches alike). The small MoE loaded the way a learner rank loads it, with
    learner.moe.leaf_modules = `leaf`. Runs in the rank process."""
    _init_rank()
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.runtime.zero.partitioned_param_coordinator import (
        PartitionedParameterCoordinator as Coordinator,
    )
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from groupflow.config.learner import LearnerConfig, MoeConfig, Zero3Config
    from groupflow.learner.model_setup import prepare_model
    from groupflow.learner.moe_blocks import moe_blocks
    from groupflow.learner.zero_config import deepspeed_config

    cfg = LearnerConfig(
        gradient_checkpointing=False,
        zero3=Zero3Config(param_persistence_threshold=0),  # every parameter partitioned
        moe=MoeConfig(leaf_modules=leaf),
    )
    plain = random_causal_lm(VOCAB, architecture="qwen3_moe", seed=0, **TINY_MOE)
    plain.save_pretrained(path)
    nparams = sum(p.numel() for p in plain.parameters())
    hf_ds_config = HfDeepSpeedConfig(deepspeed_config(cfg, "float32", nparams, world_size=1))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prepare_model(model, cfg, trainable=False)
    engine, *_ = deepspeed.initialize(model=model, config=hf_ds_config.config)
    engine.eval()
    from deepspeed.utils import z3_leaf_module

    assert all(z3_leaf_module(b) == leaf for b in moe_blocks(engine.module))
    blocks = [{id(p) for p in b.parameters()} for b in moe_blocks(engine.module)]
    gathers: list[set[int]] = []
    gather = Coordinator._PartitionedParameterCoordinator__all_gather_params

    def counted(self, params, forward):
        gathers.append({id(p) for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE})
        return gather(self, params, forward)

    Coordinator._PartitionedParameterCoordinator__all_gather_params = counted
    per_forward = []
    try:
        ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            gathers.clear()
            with torch.no_grad():
                engine(input_ids=ids)
            per_forward.append([[len(g & b) for g in gathers if g & b] for b in blocks])
    finally:
        Coordinator._PartitionedParameterCoordinator__all_gather_params = gather
    engine.destroy()
    del hf_ds_config
    return per_forward


def test_a_forward_gathers_each_moe_block_at_once_as_a_leaf_module(rank_process, tmp_path):
    """learner.moe.leaf_modules (on by default): each block is flagged a ZeRO-3 leaf, and its
    router and experts are gathered by one all-gather per forward, all three tensors together.
    (transformers 5's fused Qwen3-MoE block is gathered in one call without the flag too, as
    this test saw: the flag is what keeps it so for blocks whose experts are modules of their
    own, docs/moe.md.)"""
    leaf = rank_process.submit(moe_block_gathers, True, str(tmp_path / "leaf")).result(300)
    assert leaf == [[[3], [3]]] * 2, leaf  # two forwards x two blocks: one gather of 3 each
