"""The load-balancing auxiliary loss and the expert load of a mixture of experts on the learner
(learner/moe_aux.py), in float64 on a tiny Qwen3-MoE: the loss is Switch Transformer's (as
transformers computes it for one layer), only trained positions reach it (no padding, no
prompt, no observation token), and its denominator is the mini-batch's global token count,
as the policy loss's is."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeTopKRouter,
    load_balancing_loss_func,
)

from groupflow.config.base import ConfigError
from groupflow.config.learner import LearnerConfig, MoeConfig
from groupflow.core.random_model import random_causal_lm
from groupflow.core.records import TrainSequence
from groupflow.learner.credit import LocalReducer
from groupflow.learner.micro_batch import forward_micro_batch, model_inputs
from groupflow.learner.moe_aux import (
    MoeFigures,
    MoeRouting,
    aux_loss_sum,
    check_aux_loss,
    response_index,
)
from groupflow.learner.step import StepSettings, train_mini_batch, train_step
from groupflow.learner.token_head import install_token_head
from groupflow.run.job_config import build_config
from tests.unit.test_moe_blocks import TINY_MOE

F64 = torch.float64
VOCAB = 40
EXPERTS, TOP_K = TINY_MOE["num_experts"], TINY_MOE["num_experts_per_tok"]


def tiny_moe(seed: int = 0) -> torch.nn.Module:
    # no KV cache, as learner/model_setup.py sets: a cache would turn packing's masks off
    model = random_causal_lm(
        VOCAB, architecture="qwen3_moe", seed=seed, use_cache=False, **TINY_MOE
    )
    model = model.to(F64).train()
    model.set_experts_implementation("eager")  # torch's grouped GEMM takes no float64
    # spread the routers, so that the top-k and the probabilities vary from token to token
    for router in model.modules():
        if isinstance(router, Qwen3MoeTopKRouter):
            torch.nn.init.normal_(router.weight, std=0.5)
    install_token_head(model)
    return model


def seq(ids: list[int], prompt_len: int, advantage=0.0, loss_mask=None, group=0) -> TrainSequence:
    return TrainSequence(ids, prompt_len, advantage, group, 0, [], loss_mask=loss_mask)


def switch_loss(z: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's loss of one layer's logits, directly: E * sum_e f_e * P_e."""
    p = torch.softmax(z, -1)
    chosen = torch.zeros_like(p).scatter_(1, p.topk(TOP_K).indices, 1.0)
    return EXPERTS * (chosen.mean(0) * p.mean(0)).sum()


def test_the_loss_is_switch_transformers_per_layer_averaged_over_the_layers():
    gen = torch.Generator().manual_seed(1)
    tokens, layers = 37, 3
    logits = [torch.randn(tokens, EXPERTS, generator=gen, dtype=F64) * 2 for _ in range(layers)]
    routing = MoeRouting([], index=0, top_k=TOP_K, coef=0.1)
    routed = routing.at_positions(logits, torch.arange(tokens), torch.ones(tokens))
    per_layer = []
    for z in logits:
        per_layer.append(switch_loss(z))
        # transformers' own for one layer, in float32 (it pools several layers into one)
        hf = load_balancing_loss_func((z,), EXPERTS, TOP_K)
        torch.testing.assert_close(per_layer[-1], hf.to(F64), rtol=1e-6, atol=0)
    expected = torch.stack(per_layer).mean()
    torch.testing.assert_close(aux_loss_sum(routed) / tokens, expected, rtol=1e-12, atol=0)
    assert routed.counts.sum().item() == layers * tokens * TOP_K
    # a token of weight 0 (an observation) counts nowhere: the loss of the others alone
    weights = (torch.rand(tokens, generator=gen) < 0.6).to(F64)
    some = routing.at_positions(logits, torch.arange(tokens), weights)
    kept = weights > 0
    expected = torch.stack([switch_loss(z[kept]) for z in logits]).mean()
    torch.testing.assert_close(aux_loss_sum(some) / kept.sum(), expected, rtol=1e-12, atol=0)
    # balanced routing (top-k = E: every token takes every expert, p = 1 / E): the loss is k
    flat = [torch.zeros(EXPERTS * 5, EXPERTS, dtype=F64)]
    flat_routed = MoeRouting([], 0, EXPERTS, 0.1).at_positions(
        flat, torch.arange(EXPERTS * 5), torch.ones(EXPERTS * 5)
    )
    assert aux_loss_sum(flat_routed).item() / (EXPERTS * 5) == pytest.approx(EXPERTS)


@pytest.mark.parametrize("packed", [True, False])
def test_only_trained_positions_reach_the_loss(packed):
    """Padding, prompt positions and observation tokens get no loss terms (padding no gradient
    at all); the trained ones and the routers do."""
    model = tiny_moe()
    routing = MoeRouting.of(model, aux_loss_coef=0.1)
    captured: list[torch.Tensor] = []

    def keep(_module, _args, output):
        output[0].retain_grad()
        captured.append(output[0])

    for router in model.modules():
        if isinstance(router, Qwen3MoeTopKRouter):
            router.register_forward_hook(keep)
    seqs = [
        seq([1, 2, 3, 4, 5, 6, 7, 8, 9], 3),
        seq([9, 8, 7, 6, 5, 4], 2, loss_mask=[1, 0, 0, 1]),  # two observation tokens
        seq([11, 12], 1),  # packed behind the second: a row with padding
    ]
    forward = forward_micro_batch(
        model, seqs, 1.0, torch.device("cpu"), False, packed, None, routing
    )
    assert forward.routed.tokens.item() == 6 + 2 + 1
    aux_loss_sum(forward.routed).backward()
    x = model_inputs(seqs, torch.device("cpu"), packed)
    width = x.input_ids.shape[1]
    flat = response_index(x.positions, width)
    trained = set(flat[torch.cat(forward.masks) > 0].tolist())
    assert len(trained) == 6 + 2 + 1
    assert len(captured) == TINY_MOE["num_hidden_layers"]
    padding = set(torch.nonzero(x.input_ids.reshape(-1) == 0).reshape(-1).tolist())
    assert padding  # (no token id of these sequences is 0)
    reached = [set(torch.nonzero(z.grad.abs().sum(-1)).reshape(-1).tolist()) for z in captured]
    # the last router's loss terms are its own: the trained positions exactly; an earlier
    # router's reach a later one's through attention, within a sequence, never padding
    assert reached[-1] == trained
    assert all(trained <= r and not r & padding for r in reached)
    assert all(r.weight.grad.abs().sum() > 0 for r in routing_routers(model))


def test_the_loss_backpropagates_through_checkpointed_layers():
    """Under activation checkpointing (the learner's default) a layer's forward runs again in
    the backward, its router's hook with it: the gradient is the one without."""
    grads = []
    for checkpointing in (False, True):
        model = tiny_moe(seed=5)
        if checkpointing:  # as learner/model_setup.py enables it
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        routing = MoeRouting.of(model, 0.1)
        seqs = [seq([1, 2, 3, 4, 5, 6, 7, 8, 9], 3), seq([9, 8, 7, 6, 5], 2), seq([3, 4, 5], 1)]
        cpu = torch.device("cpu")
        forward = forward_micro_batch(model, seqs, 1.0, cpu, False, True, None, routing)
        aux_loss_sum(forward.routed).backward()
        grads.append(torch.cat([r.weight.grad.reshape(-1) for r in routing_routers(model)]))
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-12, atol=1e-14)


def routing_routers(model):
    return [m for m in model.modules() if isinstance(m, Qwen3MoeTopKRouter)]


def test_a_figure_only_routing_keeps_no_graph():
    model = tiny_moe()
    routing = MoeRouting.of(model, aux_loss_coef=0.0)
    forward = forward_micro_batch(
        model, [seq([1, 2, 3, 4], 2)], 1.0, torch.device("cpu"), False, True, None, routing
    )
    assert not any(p.requires_grad for p in forward.routed.probs)
    assert MoeRouting.of(random_causal_lm(VOCAB, seed=0), 0.0) is None  # a dense model


class RecordingPolicy:
    """A plain float64 model; keeps each loss it is handed, updates nothing."""

    def __init__(self, model):
        self.model = model
        self.device = torch.device("cpu")
        self.losses: list[torch.Tensor] = []

    def backward(self, loss, last_micro_batch):
        self.losses.append(loss.detach())
        loss.backward()

    def step(self):
        self.model.zero_grad()
        return 0.0


class TwoRanks(LocalReducer):
    """As if another rank held as many tokens as this one."""

    world_size = 2

    def sum(self, t):
        return 2 * t


def unpacked_aux(model, seqs: list[TrainSequence]) -> float:
    """The loss of each layer over the positions that predict the sequences' model
    tokens, one unpadded sequence at a time, averaged over the layers."""
    per_layer = None
    for s in seqs:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([s.input_ids]), output_router_logits=True)
        mask = torch.tensor(s.loss_mask or [1] * (len(s.input_ids) - s.prompt_len)) > 0
        cols = torch.arange(s.prompt_len - 1, len(s.input_ids) - 1)[mask]
        layers = [z[cols] for z in out.router_logits]
        per_layer = (
            layers
            if per_layer is None
            else [torch.cat(p) for p in zip(per_layer, layers, strict=True)]
        )
    losses = [switch_loss(z) for z in per_layer]
    return torch.stack(losses).mean().item()


@pytest.mark.parametrize("reducer", [LocalReducer(), TwoRanks()], ids=["one_rank", "two_ranks"])
@pytest.mark.parametrize("preset", ["grpo", "lopti"])  # planned per micro-batch; as a whole
def test_the_denominator_is_the_global_token_count_across_micro_batches(reducer, preset):
    """With zero advantages the policy loss is exactly 0: each micro-batch's loss is then its
    auxiliary term, coef * its tokens * its own loss / the tokens of all micro-batches (and
    ranks). Lopti's second pass adds its term again but counts the figures once."""
    coef = 0.05
    model = tiny_moe(seed=3)
    # Lopti's threshold amid this model's probabilities (about 1 / VOCAB): both of its passes run
    lopti = {"lopti": {"eta": 0.025}} if preset == "lopti" else {}
    algorithm = build_config({"algorithm": {"preset": preset, **lopti}}).algorithm
    settings = StepSettings.of(algorithm, 1.0, reducer, packed=True)
    settings.moe = MoeRouting.of(model, coef)
    micro_batches = [
        [seq([1, 2, 3, 4, 5, 6, 7], 2), seq([4, 5, 6, 7, 8], 3, group=1)],
        [seq([7, 3, 9, 1, 2, 2, 5, 6, 1, 3], 4, loss_mask=[1, 1, 0, 1, 1, 1], group=2)],
    ]
    policy = RecordingPolicy(model)
    figures = train_step(policy, None, [micro_batches], settings)
    tokens = [sum(s.num_model_tokens for s in mb) for mb in micro_batches]
    world = reducer.sum(torch.tensor(1.0)).item()
    expected = [
        coef * n * unpacked_aux(model, mb) / (world * sum(tokens))
        for n, mb in zip(tokens, micro_batches, strict=True)
    ]
    passes = len(policy.losses) // len(micro_batches)
    assert passes == (2 if preset == "lopti" else 1)
    got = [loss.item() for loss in policy.losses[: len(micro_batches)]]
    assert got == pytest.approx(expected, rel=1e-9)
    # the figures count each trained token once, whatever the passes
    assert figures.moe.tokens == sum(tokens)
    counts = torch.tensor(figures.moe.expert_tokens)
    assert counts.shape == (TINY_MOE["num_hidden_layers"], EXPERTS)
    assert (counts.sum(-1) == sum(tokens) * TOP_K).all()
    aux = sum(
        n * unpacked_aux(model, mb) for n, mb in zip(tokens, micro_batches, strict=True)
    ) / sum(tokens)
    assert figures.moe.record()["moe_aux_loss"] == pytest.approx(aux, rel=1e-9)


def test_without_the_coefficient_the_loss_is_the_policy_loss_alone():
    model = tiny_moe(seed=3)
    settings = StepSettings.of(build_config({}).algorithm, 1.0, LocalReducer(), packed=True)
    settings.moe = MoeRouting.of(model, 0.0)
    policy = RecordingPolicy(model)
    figures = train_mini_batch(policy, [[seq([1, 2, 3, 4, 5], 2)]], None, None, settings, True)
    assert [loss.item() for loss in policy.losses] == [0.0]  # zero advantage
    assert figures.moe.tokens == 3


def test_the_record_gives_each_layers_load_balance():
    a = MoeFigures([[4.0, 0.0, 2.0, 2.0], [2.0, 2.0, 2.0, 2.0]], aux_loss=6.0, tokens=3)
    b = MoeFigures([[4.0, 0.0, 0.0, 2.0], [2.0, 2.0, 2.0, 2.0]], aux_loss=2.0, tokens=5)
    merged = a.merge(b).merge(MoeFigures())
    assert merged.record() == {
        "expert_load_max_over_mean": {"0": 8.0 / 3.5, "1": 1.0},
        "moe_aux_loss": 1.0,
    }
    assert MoeFigures().record() == {}  # a dense model: no key


def test_the_loss_on_a_dense_model_is_refused_in_one_line(tmp_path):
    dense, moe = tmp_path / "dense", tmp_path / "moe"
    Qwen2Config(num_hidden_layers=1).save_pretrained(dense)
    Qwen3MoeConfig(num_hidden_layers=1).save_pretrained(moe)
    with pytest.raises(ConfigError) as err:
        check_aux_loss(str(dense), MoeConfig(aux_loss_coef=0.001))
    assert str(err.value) == (
        f"learner.moe.aux_loss_coef=0.001: {dense} is a dense model (its config counts no "
        "experts); the load-balancing loss needs a mixture of experts"
    )
    check_aux_loss(str(moe), MoeConfig(aux_loss_coef=0.001))
    check_aux_loss(str(dense), MoeConfig())  # off: nothing to check


def test_the_loss_with_sequence_parallelism_is_refused():
    with pytest.raises(ValueError, match="moe.aux_loss_coef > 0 with sequence_parallel_size"):
        LearnerConfig(num_ranks=2, sequence_parallel_size=2, moe=MoeConfig(aux_loss_coef=0.01))
