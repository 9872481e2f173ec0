"""Per-token policy losses and KL estimators, each against a loop.

docs/algorithms.md, 'Policy losses'.
"""

from __future__ import annotations

import math

import pytest
import torch

from groupflow.config import AlgorithmConfig
from groupflow.learner.losses import KL_ESTIMATORS, POLICY_LOSSES, token_loss
from groupflow.run.job_config import build_config

F64 = torch.float64


def algorithm(**keys) -> AlgorithmConfig:
    return build_config({"algorithm": keys}).algorithm


def random_batch(gen: torch.Generator, rows: int = 5, width: int = 7, spread: float = 0.8):
    """(logp leaf, old_logp, per-token adv, mask): ratios well outside any clip range."""
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    mask = (torch.arange(width) < lengths[:, None]).to(F64)
    old_logp = -4 * torch.rand(rows, width, generator=gen, dtype=F64)
    logp = (old_logp + spread * torch.randn(rows, width, generator=gen, dtype=F64)).requires_grad_()
    adv = torch.randn(rows, width, generator=gen, dtype=F64)
    return logp, old_logp, adv, mask


def plant_clipped_tokens(logp, old_logp, adv):
    """Column 0 (always valid) of rows 0-2: a low clip, a high clip and a dual-clip hit."""
    with torch.no_grad():
        for row, shift, sign in ((0, -1.0, -1.0), (1, 1.0, 1.0), (2, 1.5, -1.0)):
            logp[row, 0] = old_logp[row, 0] + shift
            adv[row, 0] = sign


def valid_cells(mask):
    return [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t] > 0]


def ppo_loop(logp, old_logp, adv, mask, eps_low, eps_high, dual):
    """l = -min(r A, clip(r) A); for A < 0 with dual clip, min(l, -c A). Token by token."""
    loss = torch.zeros_like(logp)
    low, high, dual_hit = (torch.zeros(mask.shape, dtype=torch.bool) for _ in range(3))
    for i, t in valid_cells(mask):
        r = torch.exp(logp[i, t] - old_logp[i, t])
        a = adv[i, t].item()
        value = -torch.minimum(r * a, torch.clamp(r, 1 - eps_low, 1 + eps_high) * a)
        low[i, t] = a < 0 and r.item() < 1 - eps_low
        high[i, t] = a > 0 and r.item() > 1 + eps_high
        if dual is not None and a < 0 and value.item() > -dual * a:
            value, dual_hit[i, t] = torch.tensor(-dual * a, dtype=F64), True
        loss = loss.index_put((torch.tensor([i]), torch.tensor([t])), value.reshape(1))
    return loss, low, high, dual_hit


@pytest.mark.parametrize("dual", [None, 3.0])
def test_ppo_matches_loop(gen, dual):
    logp, old_logp, adv, mask = random_batch(gen)
    plant_clipped_tokens(logp, old_logp, adv)
    eps_low, eps_high = 0.1 + 0.2 * torch.rand((), generator=gen).item(), 0.28
    cfg = algorithm(clip={"eps_low": eps_low, "eps_high": eps_high, "dual_clip": dual})
    out = token_loss(logp, old_logp, adv, mask, cfg)
    grad = torch.autograd.grad(out.loss.sum(), logp)[0]
    ref, low, high, dual_hit = ppo_loop(logp, old_logp, adv, mask, eps_low, eps_high, dual)
    ref_grad = torch.autograd.grad(ref.sum(), logp)[0]
    torch.testing.assert_close(out.loss, ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-14)
    assert torch.equal(out.clipped_low, low) and torch.equal(out.clipped_high, high)
    assert low.any() and high.any() and (dual is None or dual_hit.any())


def test_ppo_clipped_tokens_carry_no_gradient(gen):
    logp, old_logp, adv, mask = random_batch(gen)
    plant_clipped_tokens(logp, old_logp, adv)
    cfg = algorithm(clip={"dual_clip": 3.0})
    out = token_loss(logp, old_logp, adv, mask, cfg)
    grad = torch.autograd.grad(out.loss.sum(), logp)[0]
    *_, dual_hit = ppo_loop(logp, old_logp, adv, mask, cfg.clip.eps_low, cfg.clip.eps_high, 3.0)
    clipped = out.clipped_low | out.clipped_high | dual_hit
    assert clipped.any()
    assert torch.equal(grad[clipped], torch.zeros_like(grad[clipped]))
    assert (grad[(mask > 0) & ~clipped & (adv != 0)] != 0).all()


def gspo_sequence_form(logp, old_logp, adv_seq, mask, eps_low, eps_high):
    """GSPO's sequence loss l_i = -min(s_i A_i, clip(s_i) A_i), s_i with its full gradient."""
    losses = []
    for i in range(mask.shape[0]):
        idx = [t for t in range(mask.shape[1]) if mask[i, t] > 0]
        s = torch.exp(torch.stack([logp[i, t] - old_logp[i, t] for t in idx]).mean())
        a = adv_seq[i].item()
        losses.append(-torch.minimum(s * a, torch.clamp(s, 1 - eps_low, 1 + eps_high) * a))
    return torch.stack(losses)


@pytest.mark.parametrize("aggregation", ["seq_mean_token_mean", "token_mean"])
def test_gspo_matches_sequence_form(gen, aggregation):
    logp, old_logp, _, mask = random_batch(gen, spread=0.3)
    adv_seq = torch.randn(mask.shape[0], generator=gen, dtype=F64)
    eps_low, eps_high = 0.05, 0.08
    cfg = algorithm(loss="gspo", clip={"eps_low": eps_low, "eps_high": eps_high})
    out = token_loss(logp, old_logp, adv_seq[:, None] * mask, mask, cfg)
    seq_loss = gspo_sequence_form(logp, old_logp, adv_seq, mask, eps_low, eps_high)
    lengths = mask.sum(-1)
    # The sequence loss is spread over the valid tokens.
    torch.testing.assert_close(out.loss, seq_loss.detach()[:, None] * mask, rtol=1e-12, atol=1e-14)
    if aggregation == "seq_mean_token_mean":
        ours = (out.loss / lengths[:, None]).sum() / len(lengths)
        theirs = seq_loss.mean()
    else:
        ours = out.loss.sum() / lengths.sum()
        theirs = (seq_loss * lengths).sum() / lengths.sum()
    grad, ref_grad = (torch.autograd.grad(x, logp)[0] for x in (ours, theirs))
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-14)
    seq_ratio = torch.exp(((logp.detach() - old_logp) * mask).sum(-1) / lengths)
    expected_low = (adv_seq < 0) & (seq_ratio < 1 - eps_low)
    assert torch.equal(out.clipped_low, expected_low[:, None] & (mask > 0))


@pytest.mark.parametrize("loss", ["linear", "dfpo"])
def test_linear_losses_are_minus_a_logp_in_gradient(gen, loss):
    logp, old_logp, adv, mask = random_batch(gen)
    out = token_loss(logp, old_logp, adv, mask, algorithm(loss=loss))
    grad = torch.autograd.grad(out.loss.sum(), logp)[0]
    # Loop: value -A_it, gradient -A_it, independent of old_logp; no clipping.
    for i, t in valid_cells(mask):
        assert out.loss[i, t].item() == pytest.approx(-adv[i, t].item(), rel=1e-15)
        assert grad[i, t].item() == pytest.approx(-adv[i, t].item(), rel=1e-15)
    assert not (out.clipped_low | out.clipped_high).any()


def kl_loop(estimator: str, logp: float, ref: float) -> float:
    if estimator == "k1":
        return logp - ref
    if estimator == "k2":
        return 0.5 * (logp - ref) ** 2
    return math.exp(ref - logp) - (ref - logp) - 1


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_match_loop_and_enter_the_loss(gen, estimator):
    logp, old_logp, adv, mask = random_batch(gen)
    ref_logp = old_logp + 0.5 * torch.randn(old_logp.shape, generator=gen, dtype=F64)
    coef = 0.05
    without = token_loss(
        logp, old_logp, adv, mask, algorithm(kl={"coef": 0.0, "estimator": estimator}), ref_logp
    )
    with_kl = token_loss(
        logp, old_logp, adv, mask, algorithm(kl={"coef": coef, "estimator": estimator}), ref_logp
    )
    for i, t in valid_cells(mask):
        expected = kl_loop(estimator, logp[i, t].item(), ref_logp[i, t].item())
        assert with_kl.kl[i, t].item() == pytest.approx(expected, rel=1e-12, abs=1e-14)
    torch.testing.assert_close(
        with_kl.loss, without.loss + coef * with_kl.kl * mask, rtol=1e-12, atol=1e-14
    )
    torch.testing.assert_close(with_kl.kl, without.kl)  # the estimate is reported even at coef 0
    assert not with_kl.kl.requires_grad
    grad_kl = torch.autograd.grad((with_kl.loss - without.loss).sum(), logp)[0]
    assert (grad_kl[(mask > 0) & (logp != ref_logp)] != 0).all()


def test_kl_is_zero_without_reference_and_required_when_on(gen):
    logp, old_logp, adv, mask = random_batch(gen)
    out = token_loss(logp, old_logp, adv, mask, algorithm())
    assert torch.equal(out.kl, torch.zeros_like(out.kl))
    with pytest.raises(ValueError, match="ref_logp"):
        token_loss(logp, old_logp, adv, mask, algorithm(kl={"coef": 0.1}))


def test_entropy_bonus(gen):
    logp, old_logp, adv, mask = random_batch(gen)
    entropy = torch.rand(logp.shape, generator=gen, dtype=F64, requires_grad=True)
    plain = token_loss(logp, old_logp, adv, mask, algorithm(), entropy=entropy)
    bonus = token_loss(logp, old_logp, adv, mask, algorithm(entropy_coef=0.01), entropy=entropy)
    torch.testing.assert_close(bonus.loss, plain.loss - 0.01 * entropy * mask)
    grad = torch.autograd.grad(bonus.loss.sum(), entropy)[0]
    torch.testing.assert_close(grad, -0.01 * mask)
    with pytest.raises(ValueError, match="entropy"):
        token_loss(logp, old_logp, adv, mask, algorithm(entropy_coef=0.01))


@pytest.mark.parametrize("loss", sorted(POLICY_LOSSES))
def test_padding_is_zero_and_garbage_cannot_leak(gen, loss):
    logp, old_logp, adv, mask = random_batch(gen)
    pad = mask == 0
    assert pad.any()
    garbage = [float("nan"), float("inf"), -float("inf")]
    poisoned = [x.detach().clone() for x in (logp, old_logp, adv)]
    for k, x in enumerate(poisoned):
        x[pad] = garbage[k % 3]
    logp_p = poisoned[0].requires_grad_()
    cfg = algorithm(loss=loss, kl={"coef": 0.1}, entropy_coef=0.01, clip={"dual_clip": 3.0})
    entropy = torch.full_like(mask, float("nan"))
    entropy[~pad] = 1.0
    out = token_loss(
        logp_p, poisoned[1], poisoned[2], mask, cfg, ref_logp=poisoned[1], entropy=entropy
    )
    grad = torch.autograd.grad(out.loss.sum(), logp_p)[0]
    assert (
        torch.isfinite(out.loss).all()
        and torch.isfinite(grad).all()
        and torch.isfinite(out.kl).all()
    )
    assert torch.equal(out.loss[pad], torch.zeros_like(out.loss[pad]))
    assert torch.equal(grad[pad], torch.zeros_like(grad[pad]))
    assert not (out.clipped_low | out.clipped_high)[pad].any()
    clean = token_loss(
        logp, old_logp, adv, mask, cfg, ref_logp=old_logp, entropy=torch.ones_like(mask)
    )
    torch.testing.assert_close(out.loss, clean.loss)


@pytest.mark.parametrize("registry", [POLICY_LOSSES, KL_ESTIMATORS])
def test_registry_entries_cite_their_source(registry):
    for name, fn in registry.items():
        doc = fn.__doc__ or ""
        assert "arXiv" in doc or "Schulman" in doc or "Williams" in doc, f"{name}: cite the source"
