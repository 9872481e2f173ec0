"""No host synchronisation in a step's micro-batch loop (learner/step.py).

On a GPU, reading a tensor's value on the host (`.item()`, `.tolist()`, `float(t)`, `if t`)
or making a tensor whose size depends on values (a boolean selection, `nonzero`, `unique`)
stalls the host until the device has caught up: once per micro-batch, the host can no
longer queue the next micro-batch's kernels while the device runs this one's. The CPU cannot
show a stall, so here every such call raises while the loop's own code runs (its forwards,
losses, credit rows and backward); what a step reads once per mini-batch (the plan, the
figures, the optimizer's grad norm) stays allowed. bench/gpu_learner_probe.py counts the
synchronisations of a real step on a GPU.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from groupflow.core.random_model import random_causal_lm
from groupflow.learner import step
from groupflow.learner.moe_aux import MiniBatchRouting, MoeRouting
from groupflow.learner.step import train_step
from groupflow.learner.token_head import install_token_head
from tests.unit.test_learner_step import (
    VOCAB,
    TorchRank,
    algorithm,
    layout,
    sample_step,
    settings,
    tiny_model,
)
from tests.unit.test_moe_blocks import TINY_MOE

READS = ["item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__"]
SIZED_BY_VALUES = ["nonzero", "unique", "masked_select", "argwhere"]


class HostSyncGuard:
    """While active, every host read of a tensor's value and every value-sized result raises."""

    def __init__(self, monkeypatch):
        self.active = 0
        self.calls: list[str] = []
        for name in READS + SIZED_BY_VALUES:
            monkeypatch.setattr(torch.Tensor, name, self._refuse(getattr(torch.Tensor, name)))
        for name in SIZED_BY_VALUES:
            monkeypatch.setattr(torch, name, self._refuse(getattr(torch, name)))
        getitem = torch.Tensor.__getitem__

        def checked_getitem(tensor, index):
            parts = index if isinstance(index, tuple) else (index,)
            if self.active and any(
                isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts
            ):
                raise AssertionError("a boolean selection in the micro-batch loop")
            return getitem(tensor, index)

        monkeypatch.setattr(torch.Tensor, "__getitem__", checked_getitem)

    def _refuse(self, original):
        @functools.wraps(original)
        def refusing(*args, **kwargs):
            if self.active:
                raise AssertionError(f"{original.__name__} in the micro-batch loop")
            return original(*args, **kwargs)

        return refusing

    def guarded(self, fn):
        """`fn`, with the guard on while it runs (and the call counted)."""

        @functools.wraps(fn)
        def run(*args, **kwargs):
            self.calls.append(fn.__name__)
            self.active += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.active -= 1

        return run


class GuardedRank(TorchRank):
    def __init__(self, model, guard: HostSyncGuard):
        super().__init__(model)
        self.backward = guard.guarded(self.backward)


CASES = [
    pytest.param("grpo", {}, id="grpo"),  # each micro-batch planned from its own forward
    pytest.param("grpo", {"kl": {"coef": 0.1}, "entropy_coef": 0.05}, id="grpo-kl-entropy"),
    pytest.param("grpo", {"off_policy": {"mode": "tis"}}, id="grpo-tis"),
    pytest.param("stapo", {}, id="stapo"),  # one plan over the mini-batch
    pytest.param("lopti", {}, id="lopti"),  # two passes
]


@pytest.mark.parametrize("preset, keys", CASES)
def test_the_micro_batch_loop_reads_nothing_on_the_host(gen, monkeypatch, preset, keys):
    # with the cancellation diagnostic, whose per-token gradients the loop also collects
    algo = algorithm(preset, cancellation_diagnostic=True, **keys)
    model = tiny_model(gen)
    cut = layout(sample_step(model, gen, algo, num_groups=4), gen, 1, many_micro_batches=True)[0]
    reference = copy.deepcopy(model).eval() if algo.kl.coef > 0 else None
    guard = HostSyncGuard(monkeypatch)
    for name in ("forward_micro_batch", "micro_batch_loss", "micro_batch_rows"):
        monkeypatch.setattr(step, name, guard.guarded(getattr(step, name)))
    # The transformer's own layers are Hugging Face's, not the loop's: only its token head
    # (learner/token_head.py) is guarded inside the model.
    monkeypatch.setattr(type(model.model), "forward", _unguarded(guard, type(model.model).forward))
    policy = GuardedRank(model, guard)

    figures = train_step(policy, reference, cut, settings(algo))

    micro_batches = sum(len(mini) for mini in cut)
    assert guard.calls.count("micro_batch_loss") >= micro_batches
    assert guard.calls.count("backward") == guard.calls.count("micro_batch_loss")
    assert figures.update.tokens > 0  # the figures the loop left on the device were read


@pytest.mark.parametrize("preset", ["grpo", "stapo"])
def test_a_mixture_of_experts_loop_reads_nothing_on_the_host(gen, monkeypatch, preset):
    """The routing's figures and the load-balancing loss (learner/moe_aux.py) stay on the
    device too: observation tokens weigh 0 instead of being selected out."""
    algo = algorithm(preset)
    model = random_causal_lm(VOCAB, architecture="qwen3_moe", seed=0, use_cache=False, **TINY_MOE)
    model = model.to(torch.float64).train()
    model.set_experts_implementation("eager")  # torch's grouped GEMM takes no float64
    install_token_head(model)
    cut = layout(sample_step(model, gen, algo, num_groups=4), gen, 1, many_micro_batches=True)[0]
    guard = HostSyncGuard(monkeypatch)
    for name in ("forward_micro_batch", "micro_batch_loss", "micro_batch_rows"):
        monkeypatch.setattr(step, name, guard.guarded(getattr(step, name)))
    monkeypatch.setattr(MiniBatchRouting, "loss", guard.guarded(MiniBatchRouting.loss))
    monkeypatch.setattr(type(model.model), "forward", _unguarded(guard, type(model.model).forward))
    moe_settings = settings(algo)
    moe_settings.moe = MoeRouting.of(model, aux_loss_coef=0.01)

    figures = train_step(GuardedRank(model, guard), None, cut, moe_settings)

    assert guard.calls.count("loss") == guard.calls.count("micro_batch_loss") > 1
    assert figures.moe.tokens == figures.update.tokens > 0


def _unguarded(guard: HostSyncGuard, fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        active, guard.active = guard.active, 0
        try:
            return fn(*args, **kwargs)
        finally:
            guard.active = active

    return run


def test_the_guard_catches_a_read(gen, monkeypatch):
    """The guard itself: a loop that reads a figure per micro-batch, as the loss once did,
    fails."""
    guard = HostSyncGuard(monkeypatch)
    original = step.micro_batch_loss

    def reads_a_figure(*args, **kwargs):
        out = original(*args, **kwargs)
        out.figure_sums.tolist()
        return out

    monkeypatch.setattr(step, "micro_batch_loss", guard.guarded(reads_a_figure))
    algo = algorithm("grpo")
    model = tiny_model(gen)
    cut = layout(sample_step(model, gen, algo, num_groups=4), gen, 1, many_micro_batches=True)[0]
    with pytest.raises(AssertionError, match="tolist in the micro-batch loop"):
        train_step(TorchRank(model), None, cut, settings(algo))
