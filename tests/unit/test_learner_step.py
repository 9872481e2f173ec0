"""A learner step on a tiny float64 transformer (learner/step.py, without DeepSpeed).

Property 3 of docs/algorithms.md ('Properties the tests check') for the whole step: for every
preset, with the cancellation diagnostic on and off, cutting the step into many micro-batches
or onto two ranks leaves the parameter update unchanged. And the proximal statistics that the first
mini-batch takes from its own forward give bit for bit the update of a separate forward,
and a micro-batch planned from its own forward (no forward for statistics alone) gives the
update of the plan made over the whole mini-batch.
"""

from __future__ import annotations

import copy
from dataclasses import astuple

import pytest
import torch

from groupflow.config import AlgorithmConfig
from groupflow.config.presets import PRESETS
from groupflow.core.random_model import random_causal_lm
from groupflow.core.records import TrainSequence
from groupflow.learner.advantages import compute_advantages
from groupflow.learner.credit import LocalReducer, plans_per_micro_batch
from groupflow.learner.figures import RankFigures
from groupflow.learner.step import (
    MicroBatches,
    StepSettings,
    no_grad_stats,
    plan_each_micro_batch,
    plan_whole_mini_batch,
    train_mini_batch,
    train_step,
)
from groupflow.learner.token_head import install_token_head
from groupflow.run.job_config import build_config
from tests.unit.threaded_ranks import RankReducer, ThreadedRanks

F64 = torch.float64
VOCAB, GROUP_SIZE, TEMPERATURE = 48, 4, 0.8
LR = 0.02


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: intra-op threads only add synchronisation (and two simulated ranks
    would each start a pool on the same cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(gen: torch.Generator, architecture: str = "qwen2") -> torch.nn.Module:
    """A random 2-layer causal LM in float64, with logits spread wide enough that sampled tokens
    range from p < 0.002 (STAPO's candidates) to p > 0.5 (Lopti's high side)."""
    model = random_causal_lm(
        VOCAB,
        architecture=architecture,
        seed=int(torch.randint(0, 2**31, (), generator=gen)),
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.6,
        use_cache=False,
    )
    model = model.to(F64).train()
    install_token_head(model)  # as learner/model_setup.py prepares a rank's model
    return model


def sample_step(
    model: torch.nn.Module, gen: torch.Generator, algo: AlgorithmConfig, num_groups: int = 8
) -> list[TrainSequence]:
    """Groups of responses sampled from the model: a prefix shared by the whole group, then
    each response's own tokens (one in five drawn uniformly instead, for low-p tokens)."""
    seqs = []
    for group in range(num_groups):
        prompt = torch.randint(
            0, VOCAB, (int(torch.randint(1, 5, (), generator=gen)),), generator=gen
        )
        stem = _sample(model, prompt[None], int(torch.randint(0, 4, (), generator=gen)), gen)[0]
        lengths = torch.randint(1, 9, (GROUP_SIZE,), generator=gen).tolist()
        rows = _sample(model, stem.expand(GROUP_SIZE, -1), max(lengths), gen)
        rewards = torch.rand(GROUP_SIZE, generator=gen, dtype=F64).round()
        rewards[0] = 1 - rewards[1]  # mixed rewards: the group has a signal
        advantages = compute_advantages(
            rewards,
            torch.zeros(GROUP_SIZE, dtype=torch.int64),
            algo.advantage,
            algo.std,
            token_counts=torch.tensor(lengths),
        )
        for i, length in enumerate(lengths):
            ids = rows[i, : len(stem) + length].tolist()
            response_len = len(ids) - len(prompt)
            vllm = [] if i % 2 else (-3 * torch.rand(response_len, generator=gen)).tolist()
            seqs.append(
                TrainSequence(
                    input_ids=ids,
                    prompt_len=len(prompt),
                    advantage=advantages[i].item(),
                    group_id=group,
                    policy_version=0,
                    vllm_logprobs=vllm,
                )
            )
    return seqs


@torch.no_grad()
def _sample(model, ids: torch.Tensor, steps: int, gen: torch.Generator) -> torch.Tensor:
    for _ in range(steps):
        logits = model(input_ids=ids).logits[:, -1] / TEMPERATURE
        token = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
        uniform = torch.randint(0, VOCAB, token.shape, generator=gen)
        token = torch.where(torch.rand(token.shape, generator=gen) < 0.2, uniform, token)
        ids = torch.cat([ids, token], dim=1)
    return ids


# ----- layouts: how one step is cut into mini-batches, ranks and micro-batches ----------------

Layout = list[list[MicroBatches]]  # [rank][mini-batch][micro-batch] -> sequences


def layout(
    seqs: list[TrainSequence],
    gen: torch.Generator,
    world_size: int,
    many_micro_batches: bool,
    mini_batches: int = 2,
) -> Layout:
    """learner/batching.py's rules, drawn at random: whole groups per mini-batch and per rank
    (a rank may get none), a rank's sequences shuffled across its groups, then cut into
    micro-batches of 1..5 sequences or kept whole; every rank gets as many micro-batches as
    the busiest one, padded with empty ones."""
    group_ids = sorted({s.group_id for s in seqs})
    out: Layout = [[] for _ in range(world_size)]
    for m in range(mini_batches):
        groups = group_ids[
            m * len(group_ids) // mini_batches : (m + 1) * len(group_ids) // mini_batches
        ]
        owner = {g: int(torch.randint(0, world_size, (), generator=gen)) for g in groups}
        shares = []
        for rank in range(world_size):
            share = [s for s in seqs if owner.get(s.group_id) == rank]
            share = [share[i] for i in torch.randperm(len(share), generator=gen)]
            shares.append(_cut(share, gen) if many_micro_batches else [share])
        depth = max(len(share) for share in shares)
        for rank, share in enumerate(shares):
            out[rank].append(share + [[] for _ in range(depth - len(share))])
    return out


def _cut(share: list[TrainSequence], gen: torch.Generator) -> MicroBatches:
    cuts, start = [], 0
    while start < len(share):
        size = int(torch.randint(1, 6, (), generator=gen))
        cuts.append(share[start : start + size])
        start += size
    return cuts or [[]]


# ----- ranks: a plain torch model as a data-parallel rank -------------------------------------


class TorchRank:
    """learner/step.py's Policy over a plain torch model. At each update the ranks' gradients
    are summed, as ZeroPolicy's are, then plain SGD: an update linear in the gradient, so any
    change of the gradient shows in it (Adam's first step would hide a scale)."""

    def __init__(self, model, ranks: ThreadedRanks | None = None, rank: int = 0):
        self.model, self.ranks, self.rank = model, ranks, rank
        self.device = torch.device("cpu")
        self.forwards = 0
        model.register_forward_pre_hook(self._count)

    def _count(self, module, args) -> None:
        self.forwards += 1

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        loss.backward()

    def step(self) -> float:
        params = list(self.model.parameters())
        grad = torch.cat(
            [(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1) for p in params]
        )
        if self.ranks is not None:
            grad = torch.stack(self.ranks.exchange(self.rank, grad)).sum(0)
        with torch.no_grad():
            for p, g in zip(params, grad.split([p.numel() for p in params]), strict=True):
                p -= LR * g.view_as(p)
                p.grad = None
        return grad.norm().item()


def settings(algo: AlgorithmConfig, reducer=None) -> StepSettings:
    return StepSettings(algo, TEMPERATURE, reducer or LocalReducer())


def run_step(model, algo: AlgorithmConfig, cut: Layout) -> tuple[list[torch.Tensor], RankFigures]:
    """One step on copies of `model`, one per rank: rank 0's parameter update and the merged
    figures of all ranks."""
    reference = copy.deepcopy(model).eval() if algo.kl.coef > 0 else None
    before = [p.detach().clone() for p in model.parameters()]
    world_size = len(cut)
    if world_size == 1:
        policies = [TorchRank(copy.deepcopy(model))]
        results = [train_step(policies[0], reference, cut[0], settings(algo))]
    else:
        ranks = ThreadedRanks(world_size)
        policies = [TorchRank(copy.deepcopy(model), ranks, r) for r in range(world_size)]
        results = ranks.run(
            lambda r: train_step(
                policies[r], reference, cut[r], settings(algo, RankReducer(ranks, r))
            )
        )
    after = [list(p.model.parameters()) for p in policies]
    for other in after[1:]:  # the ranks stay replicas of one model
        assert all(torch.equal(a, b) for a, b in zip(after[0], other, strict=True))
    merged = results[0]
    for result in results[1:]:
        merged = merged.merge(result)
    return [a.detach() - b for a, b in zip(after[0], before, strict=True)], merged


def algorithm(preset: str, **keys) -> AlgorithmConfig:
    return build_config({"algorithm": {"preset": preset, **keys}}).algorithm


# ----- property: micro-batches and ranks do not change the update ----------------------------

CASES = [pytest.param(p, {}, id=p) for p in sorted(PRESETS)] + [
    pytest.param("grpo", {"kl": {"coef": 0.1}, "entropy_coef": 0.05}, id="grpo-kl-entropy"),
    pytest.param("lopti", {"aggregation": "seq_mean_token_mean"}, id="lopti-seq-mean"),
]


@pytest.mark.parametrize("diagnostic", [True, False], ids=["diagnostic", "no-diagnostic"])
@pytest.mark.parametrize("preset, keys", CASES)
def test_micro_batches_and_ranks_leave_the_update_unchanged(gen, preset, keys, diagnostic):
    algo = algorithm(preset, cancellation_diagnostic=diagnostic, **keys)
    model = tiny_model(gen)
    seqs = sample_step(model, gen, algo)
    base_delta, base = run_step(model, algo, layout(seqs, gen, 1, many_micro_batches=False))
    assert max(d.abs().max().item() for d in base_delta) > 0, "the step must change the model"
    if algo.stapo.enabled:
        assert max(c.stapo_silenced_frac for c in base.credit) > 0, "STAPO must silence something"
    if algo.lopti.enabled:
        assert base.optimizer_updates == 4, "both Lopti passes of both mini-batches must run"
    if diagnostic:
        # The entropy mask keeps a fifth of the tokens: where every token that responses share
        # falls outside it (1 seed in 60 for the shared nodes, GROUPFLOW_TEST_SEED=14; more
        # often for the nodes a whole group shares), no such node carries a gradient and both
        # sides compare zeros.
        assert base.residual.weight > 0 or algo.entropy_mask.enabled
        assert base.residual_whole_group.weight > 0 or algo.entropy_mask.enabled

    for world_size, many in [(1, True), (2, False), (2, True)]:
        cut = layout(seqs, gen, world_size, many_micro_batches=many)
        delta, figures = run_step(model, algo, cut)
        scale = max(d.abs().max().item() for d in base_delta)
        for got, want in zip(delta, base_delta, strict=True):
            # The second mini-batch's gradient is taken at parameters that already differ in
            # the last bits (sums in another order); this tiny model's steep logits can magnify
            # that to ~1e-8 of the update (seen). A row paired with the wrong sequence is O(1).
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7 * scale)
        assert_same_figures(figures, base)


def assert_same_figures(got: RankFigures, want: RankFigures) -> None:
    """Equal up to rounding; figures of the second mini-batch are taken at parameters that
    differ in the last bits, magnified as in the update (see above)."""
    assert astuple(got.proximal) == pytest.approx(astuple(want.proximal), rel=1e-12)
    assert astuple(got.update) == pytest.approx(astuple(want.update), rel=1e-7, abs=1e-15)
    assert got.residual.value == pytest.approx(want.residual.value, rel=1e-7, abs=1e-12)
    assert got.residual.weight == want.residual.weight
    assert got.residual_whole_group.value == pytest.approx(
        want.residual_whole_group.value, rel=1e-7, abs=1e-12
    )
    assert [astuple(c) for c in got.credit] == [
        pytest.approx(astuple(c), rel=1e-12) for c in want.credit
    ]
    assert got.grad_norms == pytest.approx(want.grad_norms, rel=1e-7)


def test_dfpo_cancels_on_prefixes_the_whole_group_shares(gen):
    algo = algorithm("dfpo")
    model = tiny_model(gen, "llama")
    seqs = sample_step(model, gen, algo)
    _, figures = run_step(model, algo, layout(seqs, gen, 2, many_micro_batches=True))
    assert figures.residual_whole_group.weight > 0
    assert figures.residual_whole_group.value < 1e-12
    assert figures.residual.value > 1e-6  # nodes shared by part of a group keep their credit


# ----- no wasted work: old-policy statistics from the update's own forward ---------------------


def reference_logp(model, mini: MicroBatches, algo: AlgorithmConfig):
    """The frozen KL reference (a copy of `model`) and its log-probs per micro-batch and
    sequence of `mini`, with KL on; (None, None) without."""
    if algo.kl.coef == 0:
        return None, None
    reference = copy.deepcopy(model).eval()
    stats = no_grad_stats(reference, mini, settings(algo), torch.device("cpu"))
    return reference, [[s.logp for s in mb] for mb in stats]


@pytest.mark.parametrize("preset, keys", CASES)
def test_proximal_statistics_from_the_first_forward_are_bit_identical(gen, preset, keys):
    """A mini-batch of one micro-batch at the proximal weights: taking old_logp from its own
    forward gives exactly the update of a separate no-grad proximal forward."""
    algo = algorithm(preset, **keys)
    model = tiny_model(gen)
    mini = layout(sample_step(model, gen, algo), gen, 1, False, mini_batches=1)[0][0]
    reference, ref_logp = reference_logp(model, mini, algo)

    fused = TorchRank(copy.deepcopy(model))
    fused_figures = train_step(fused, reference, [mini], settings(algo))
    separate = TorchRank(copy.deepcopy(model))
    old = no_grad_stats(separate.model, mini, settings(algo), separate.device)
    separate_figures = train_mini_batch(
        separate, mini, old, ref_logp, settings(algo), at_proximal_weights=True
    )

    for a, b in zip(fused.model.parameters(), separate.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert fused_figures == separate_figures
    passes = fused_figures.optimizer_updates
    assert fused.forwards == passes  # one forward per pass, nothing for statistics alone
    assert separate.forwards == passes + 1


def test_forwards_per_step(gen):
    """Two mini-batches, no Lopti: the second mini-batch's old_logp needs a forward before the
    first update, and, where each micro-batch is planned on its own (grpo), nothing else runs
    without a gradient."""
    algo = algorithm("grpo")
    model = tiny_model(gen)
    cut = layout(sample_step(model, gen, algo), gen, 1, many_micro_batches=False)
    policy = TorchRank(copy.deepcopy(model))
    train_step(policy, None, cut[0], settings(algo))
    assert policy.forwards == 3

    many = layout(sample_step(model, gen, algo), gen, 1, many_micro_batches=True)
    counts = [len(mini) for mini in many[0]]
    assert counts[0] > 1
    policy = TorchRank(copy.deepcopy(model))
    train_step(policy, None, many[0], settings(algo))
    assert policy.forwards == sum(counts) + counts[1]

    # A plan over the whole mini-batch (STAPO's quantile) takes its statistics from no-grad
    # forwards: the proximal forward of every micro-batch, then the current policy's for
    # mini-batch 2.
    stapo = algorithm("stapo")
    policy = TorchRank(copy.deepcopy(model))
    train_step(policy, None, many[0], settings(stapo))
    assert policy.forwards == sum(counts) + counts[1] + sum(counts)


EACH = [p for p in CASES if plans_per_micro_batch(algorithm(p.values[0], **p.values[1]))]


def test_presets_planned_per_micro_batch():
    assert {p.values[0] for p in EACH} == {"ar", "dapo", "dr_grpo", "grpo", "gspo"}


@pytest.mark.parametrize("diagnostic", [True, False], ids=["diagnostic", "no-diagnostic"])
@pytest.mark.parametrize("at_proximal_weights", [True, False], ids=["first", "later"])
@pytest.mark.parametrize("preset, keys", EACH)
def test_each_micro_batch_planned_alone_gives_the_whole_plans_update(
    gen, preset, keys, at_proximal_weights, diagnostic
):
    """Many micro-batches of one mini-batch: planned one by one from their own forwards, or
    from the whole mini-batch's statistics, the update and every figure agree in float64. At
    a later mini-batch the proximal statistics are given, from other weights."""
    algo = algorithm(preset, cancellation_diagnostic=diagnostic, **keys)
    model = tiny_model(gen)
    seqs = sample_step(model, gen, algo)
    (mini,) = layout(seqs, gen, 1, many_micro_batches=True, mini_batches=1)[0]
    assert len(mini) > 1
    proximal = None
    if not at_proximal_weights:  # the old policy: the model one SGD step earlier
        older = copy.deepcopy(model)
        train_step(TorchRank(older), None, [[seqs]], settings(algorithm("grpo")))
        proximal = no_grad_stats(older, mini, settings(algo), torch.device("cpu"))
    _, ref_logp = reference_logp(model, mini, algo)

    each = TorchRank(copy.deepcopy(model))
    got = plan_each_micro_batch(each, mini, proximal, ref_logp, settings(algo))
    whole = TorchRank(copy.deepcopy(model))
    old = proximal or no_grad_stats(whole.model, mini, settings(algo), whole.device)
    want = plan_whole_mini_batch(whole, mini, old, ref_logp, settings(algo), at_proximal_weights)

    deltas = [
        [
            (a - p0).detach()
            for a, p0 in zip(rank.model.parameters(), model.parameters(), strict=True)
        ]
        for rank in (each, whole)
    ]
    assert max(d.abs().max().item() for d in deltas[1]) > 0, "the step must change the model"
    for got_delta, want_delta in zip(*deltas, strict=True):
        torch.testing.assert_close(got_delta, want_delta, rtol=1e-12, atol=1e-15)
    assert_same_figures(got, want)
    assert each.forwards == len(mini)  # nothing for statistics alone
    # the whole plan's statistics: the proximal ones, or the current policy's, without a graph
    assert whole.forwards == 2 * len(mini)


def test_proximal_statistics_must_be_given_for_several_micro_batches_of_a_whole_plan(gen):
    model = tiny_model(gen)
    seqs = sample_step(model, gen, algorithm("stapo"), num_groups=2)
    with pytest.raises(ValueError, match="single micro-batch"):
        train_mini_batch(
            TorchRank(model), [seqs[:3], seqs[3:]], None, None, settings(algorithm("stapo")), True
        )
    # planned per micro-batch, only the weights matter
    grpo = settings(algorithm("grpo"))
    with pytest.raises(ValueError, match="only at the proximal weights"):
        train_mini_batch(TorchRank(model), [seqs[:3], seqs[3:]], None, None, grpo, False)
