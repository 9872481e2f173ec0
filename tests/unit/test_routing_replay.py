"""Rollout routing replay and the routing disagreement (learner/routing_replay.py), in float64
on a tiny Qwen3-MoE through the learner's own forward (learner/micro_batch.py): the replayed
forward is the plain one where the routing is the same, the chosen experts are the engine's
where it is not, the gradient reaches the chosen experts' router rows only, and a dense model
or a batch without routing is refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from groupflow.config.base import ConfigError
from groupflow.config.learner import LearnerConfig, MoeConfig
from groupflow.core.errors import RunError
from groupflow.core.random_model import random_causal_lm
from groupflow.core.records import TrainSequence
from groupflow.learner.micro_batch import response_token_stats
from groupflow.learner.model_setup import prepare_model
from groupflow.learner.routing_replay import (
    RoutingCounts,
    check_replay_model,
    check_routing,
    routing_grid,
    routing_state,
)
from tests.unit.test_moe_blocks import TINY_MOE

CPU = torch.device("cpu")
VOCAB = 40


def _moe(replay: str, checkpointing: bool = False):
    torch.set_num_threads(1)
    # the gate weights renormalised over the chosen experts, as Qwen3-30B-A3B's and the small
    # MoE's (groupflow/run/small_moe.py) are
    shape = TINY_MOE | {"norm_topk_prob": True}
    model = random_causal_lm(VOCAB, architecture="qwen3_moe", seed=0, **shape).double()
    model.set_experts_implementation("eager")  # torch's grouped GEMM takes no float64
    cfg = LearnerConfig(
        moe=MoeConfig(routing_replay=replay, leaf_modules=False),
        gradient_checkpointing=checkpointing,
    )
    prepare_model(model, cfg, trainable=True)
    return model


def _chosen(model) -> dict[int, torch.Tensor]:
    """Each layer's expert indices as the experts receive them (after any replay)."""
    seen: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):

        def keep(module, args, output, i=i):
            seen[i] = output[2].detach().clone()

        layer.mlp.gate.register_forward_hook(keep)
    return seen


def _seqs(routing=None) -> list[TrainSequence]:
    ids = [[3, 9, 14, 2, 7, 21, 5, 30], [11, 4, 4, 19, 8], [1, 2, 3, 4, 5, 6, 7]]
    return [
        TrainSequence(s, 2, 1.0, g, 0, [], routed_experts=None if routing is None else routing[g])
        for g, s in enumerate(ids)
    ]


def _own_routing(model, packed: bool) -> list[np.ndarray]:
    """Each sequence's own routing, (tokens - 1, layers, k), as the engine would return it."""
    out = []
    seen = _chosen(model)
    for seq in _seqs():
        with torch.no_grad():
            response_token_stats(model, [seq], 1.0, CPU, False, packed)
        layers = torch.stack([seen[i][0] if seen[i].dim() == 3 else seen[i] for i in sorted(seen)])
        out.append(layers.permute(1, 0, 2)[: len(seq.input_ids) - 1].numpy().astype(np.uint8))
    return out


@pytest.mark.parametrize("packed", [True, False])
def test_the_replayed_forward_is_the_plain_forward_where_the_routing_is_the_same(packed):
    model = _moe("rollout")
    routing = _own_routing(model, packed)
    with torch.no_grad():
        plain = response_token_stats(model, _seqs(), 1.0, CPU, False, packed)
        routing_state(model).take_counts()
        replayed = response_token_stats(model, _seqs(routing), 1.0, CPU, False, packed)
    # Transformers' router rounds its gate weights to float32; replay computes them in the
    # logits' dtype (float64 here): the same to float32's rounding
    for a, b in zip(plain, replayed, strict=True):
        assert torch.allclose(a.logp, b.logp, rtol=0, atol=1e-6)
    # every known (token, layer) pair compared, none differing
    assert routing_state(model).take_counts() == RoutingCounts(0, sum(len(r) for r in routing) * 2)


def _other_routing(routing: list[np.ndarray]) -> list[np.ndarray]:
    """Experts 0 and 1 for every token of the last layer, and the own routing before it (so
    that the learner's own top-k there is what the plain forward chose)."""
    other = [r.copy() for r in routing]
    for r in other:
        r[:, -1] = [0, 1]
    return other


@pytest.mark.parametrize("packed", [True, False])
def test_the_experts_are_the_engines_and_the_disagreement_counts_the_differing_sets(packed):
    model = _moe("rollout")
    routing = _own_routing(model, packed)
    other = _other_routing(routing)
    seen = _chosen(model)
    with torch.no_grad():
        plain = response_token_stats(model, _seqs(), 1.0, CPU, False, False)
        routing_state(model).take_counts()
        replayed = response_token_stats(model, _seqs(other), 1.0, CPU, False, False)
    last = seen[1].reshape(len(other), -1, 2)  # padded rows of width 8
    for row, r in enumerate(other):
        assert (last[row, : len(r)] == torch.tensor([0, 1])).all()
    assert any(not torch.allclose(a.logp, b.logp) for a, b in zip(plain, replayed, strict=True))
    differing = sum(int((np.sort(r[:, -1], -1) != [0, 1]).any(-1).sum()) for r in routing)
    assert differing > 0
    assert routing_state(model).take_counts() == RoutingCounts(
        differing, sum(len(r) for r in routing) * 2
    )


@pytest.mark.parametrize("mode", ["off", "observe"])
def test_without_replay_the_disagreement_is_counted_and_the_routing_is_the_learners(mode):
    """'observe' is 'off' in the learner (the engines return routing in both 'observe' and
    'rollout': tests/unit/test_config.py)."""
    model = _moe(mode)
    routing = _own_routing(model, True)
    other = _other_routing(routing)
    with torch.no_grad():
        plain = response_token_stats(model, _seqs(), 1.0, CPU, False, True)
        routing_state(model).take_counts()
        same = response_token_stats(model, _seqs(other), 1.0, CPU, False, True)
    for a, b in zip(plain, same, strict=True):
        assert torch.equal(a.logp, b.logp)
    assert routing_state(model).take_counts().differing > 0


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_gradient_reaches_the_chosen_experts_router_rows_only(checkpointing):
    """Experts 0 and 1 chosen for every token of the last layer: the router's rows of experts 2 and 3
    get no gradient, nor do those experts; with activation checkpointing, whose backward
    recomputes each layer, the gradient is the same."""
    grads = []
    for replay in ("rollout", "off"):
        model = _moe(replay, checkpointing)
        model.train()
        other = _other_routing(_own_routing(model, True))
        stats = response_token_stats(model, _seqs(other), 1.0, CPU, False, True)
        torch.cat([s.logp for s in stats]).sum().backward()
        mlp = model.model.layers[1].mlp
        grads.append((mlp.gate.weight.grad.clone(), mlp.experts.gate_up_proj.grad.clone()))
    (router, experts), (own_router, _) = grads
    assert (router[2:] == 0).all() and (experts[2:] == 0).all()
    assert (router[:2].abs().sum(-1) > 0).all() and (experts[:2].abs().sum((-1, -2)) > 0).all()
    assert (own_router[2:].abs().sum(-1) > 0).any()  # the learner's own routing reaches them
    if checkpointing:
        plain = _moe("rollout")
        stats = response_token_stats(plain, _seqs(other), 1.0, CPU, False, True)
        torch.cat([s.logp for s in stats]).sum().backward()
        assert torch.allclose(plain.model.layers[1].mlp.gate.weight.grad, router, atol=1e-12)


def test_replay_on_a_dense_model_is_refused_in_one_line():
    model = random_causal_lm(VOCAB, seed=0, hidden_size=16, intermediate_size=32)
    with pytest.raises(ConfigError) as err:
        prepare_model(model, LearnerConfig(moe=MoeConfig(routing_replay="rollout")))
    assert "learner.moe.routing_replay" in str(err.value) and "\n" not in str(err.value)


def test_a_batch_without_the_engines_routing_is_refused_in_one_line():
    routing = [np.zeros((len(s.input_ids) - 1, 2, 2), np.uint8) for s in _seqs()]
    check_routing(_seqs(routing))
    with pytest.raises(RunError) as err:
        check_routing(_seqs(routing[:2] + [None]))
    assert "routing_replay" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(RunError):
        check_routing(_seqs([r[:-1] for r in routing]))  # one trained token short
    # a trajectory that ends in an observation: no request ran it, nothing trained follows it
    ids = list(range(10))
    trailing = TrainSequence(ids, 2, 1.0, 0, 0, [], [1, 1, 1, 0, 0, 0, 0, 0], routing[0][:4])
    check_routing([trailing])
    with pytest.raises(RunError):
        trailing.routed_experts = routing[0][:3]
        check_routing([trailing])


def test_the_grid_lays_each_sequences_routing_where_its_ids_are():
    a, b = np.full((3, 2, 2), 1, np.uint8), np.full((2, 2, 2), 2, np.uint8)
    grid = routing_grid([a, None, b], rows=[0, 0, 1], starts=[0, 4, 1], width=6, num_rows=2)
    assert grid.known.tolist() == [[1, 1, 1, 0, 0, 0], [0, 1, 1, 0, 0, 0]]
    assert grid.experts[1, 1:3].eq(2).all() and grid.experts[0, :3].eq(1).all()
    shard = grid.columns(3, 3)
    assert shard.known.tolist() == [[0, 0, 0], [0, 0, 0]]
    assert routing_grid([None], [0], [0], 4, 1) is None


def test_a_job_with_replay_on_a_dense_model_stops_before_it_starts(tmp_path):
    random_causal_lm(VOCAB, seed=0, hidden_size=16, intermediate_size=32).save_pretrained(
        tmp_path / "dense"
    )
    random_causal_lm(VOCAB, architecture="qwen3_moe", seed=0, **TINY_MOE).save_pretrained(
        tmp_path / "moe"
    )
    for mode in ("rollout", "observe"):
        check_replay_model(str(tmp_path / "moe"), mode)
        with pytest.raises(ConfigError) as err:
            check_replay_model(str(tmp_path / "dense"), mode)
        said = str(err.value)
        assert said.startswith(f"learner.moe.routing_replay: {mode!r} needs a mixture of experts")
        assert "\n" not in said
