"""Property 2, token gradient cancellation on a shared prefix.

docs/algorithms.md, 'Properties the tests check', property 2.

A tiny recurrent language model (float64) computes the logits of a prefix that all responses
of a group share ONCE, as one tensor, and every response continues from it. Autograd then
sums the gradient that each response sends to those shared logits: exactly what the policy
update does to a token that appears in the same context in every response.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from groupflow.learner.advantages import compute_advantages
from groupflow.learner.credit import LocalReducer, MiniBatchTokens, plan_credit
from groupflow.learner.diagnostics import cancellation_residual
from groupflow.learner.losses import token_loss
from groupflow.run.job_config import build_config

F64 = torch.float64
VOCAB, DIM, GROUP_SIZE = 11, 6, 4


class TinyLM:
    """h_t = tanh(h_{t-1} W + E[x_t]), logits = h_t H: every logit depends on the whole prefix."""

    def __init__(self, gen: torch.Generator):
        self.embed = torch.randn(VOCAB, DIM, generator=gen, dtype=F64, requires_grad=True)
        self.recur = (0.5 * torch.randn(DIM, DIM, generator=gen, dtype=F64)).requires_grad_()
        self.head = torch.randn(DIM, VOCAB, generator=gen, dtype=F64, requires_grad=True)

    def step(self, h: torch.Tensor, token: int) -> torch.Tensor:
        return torch.tanh(h @ self.recur + self.embed[token])

    def run(self, h: torch.Tensor, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits predicting each of `tokens` from state h, and the state after them."""
        logits = []
        for token in tokens:
            logits.append(h @ self.head)
            h = self.step(h, token)
        return torch.stack(logits), h


@dataclass
class Group:
    shared_logits: torch.Tensor  # [P, V]: the prefix's logits, one tensor for the whole group
    responses: list[list[int]]  # prefix + own suffix
    logits: list[torch.Tensor]  # per response [L_i, V]


def sample_group(model: TinyLM, gen: torch.Generator, suffix_lengths: list[int]) -> Group:
    """A prompt, a shared prefix, then suffixes whose first tokens all differ, so the prefix
    tokens are the only (context, token) pairs shared by two or more responses."""
    prompt = torch.randint(0, VOCAB, (3,), generator=gen).tolist()
    prefix = torch.randint(
        0, VOCAB, (torch.randint(2, 5, (), generator=gen).item(),), generator=gen
    ).tolist()
    h = model.run(torch.zeros(DIM, dtype=F64), prompt)[1]
    shared_logits, h = model.run(h, prefix)
    shared_logits.retain_grad()
    firsts = torch.randperm(VOCAB, generator=gen)[: len(suffix_lengths)].tolist()
    responses, logits = [], []
    for first, length in zip(firsts, suffix_lengths, strict=True):
        suffix = [first] + torch.randint(0, VOCAB, (length - 1,), generator=gen).tolist()
        responses.append(prefix + suffix)
        logits.append(torch.cat([shared_logits, model.run(h, suffix)[0]]))
    return Group(shared_logits, responses, logits)


def policy_update(
    groups: list[Group], rewards: torch.Tensor, cfg
) -> tuple[torch.Tensor, list[int]]:
    """Backward of the learner's loss at r = 1; returns dLoss/dlogp [B, T] and the lengths."""
    responses = [r for g in groups for r in g.responses]
    lengths = [len(r) for r in responses]
    width = max(lengths)
    logp_rows, entropy_rows, sum_p2_rows = [], [], []
    for logits, tokens in zip([lg for g in groups for lg in g.logits], responses, strict=True):
        logp_all = F.log_softmax(logits, dim=-1)
        pad = (0, width - len(tokens))
        logp_rows.append(F.pad(logp_all.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1), pad))
        p = logp_all.detach().exp()
        entropy_rows.append(F.pad(-(p * logp_all.detach()).sum(-1), pad))
        sum_p2_rows.append(F.pad((p * p).sum(-1), pad))
    logp = torch.stack(logp_rows)
    logp.retain_grad()
    group_ids = torch.arange(len(groups)).repeat_interleave(GROUP_SIZE)
    entropy = torch.stack(entropy_rows)
    tokens = MiniBatchTokens(
        mask=(torch.arange(width) < torch.tensor(lengths)[:, None]).to(F64),
        old_logp=logp.detach(),  # on-policy: r = 1
        cur_logp=logp.detach(),
        old_entropy=entropy,
        cur_entropy=entropy,
        cur_sum_p2=torch.stack(sum_p2_rows),
        advantages=compute_advantages(rewards, group_ids, "grpo"),
        group_ids=group_ids,
    )
    plan = plan_credit(tokens, cfg, LocalReducer())
    out = token_loss(logp, tokens.old_logp, plan.token_adv, tokens.mask, cfg)
    sum((coef * out.loss).sum() for coef in plan.passes).backward()
    return logp.grad, lengths


def residual(groups: list[Group], grad: torch.Tensor, lengths: list[int]) -> float:
    """cancellation_residual over the groups, fed with the autograd dLoss/dlogp of each token."""
    per_group, row = [], 0
    for group in groups:
        per_group.append(
            [
                (tokens, grad[row + k, : lengths[row + k]])
                for k, tokens in enumerate(group.responses)
            ]
        )
        row += len(group.responses)
    return cancellation_residual(per_group).value


def run_case(gen: torch.Generator, loss: str, aggregation: str, equal_lengths: bool):
    model = TinyLM(gen)
    groups = []
    for _ in range(2):
        if equal_lengths:
            lengths = [torch.randint(1, 6, (), generator=gen).item()] * GROUP_SIZE
        else:
            lengths = [1, 5] + torch.randint(1, 6, (GROUP_SIZE - 2,), generator=gen).tolist()
        groups.append(sample_group(model, gen, lengths))
    rewards = torch.rand(2 * GROUP_SIZE, generator=gen, dtype=F64)  # mixed, all distinct
    cfg = build_config({"algorithm": {"loss": loss, "aggregation": aggregation}}).algorithm
    grad, lengths = policy_update(groups, rewards, cfg)
    prefix_grad = max(g.shared_logits.grad.abs().max().item() for g in groups)
    token_grad = grad.abs().max().item()
    return prefix_grad, token_grad, residual(groups, grad, lengths)


@pytest.mark.parametrize("loss", ["ppo", "linear", "dfpo"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_sum", "constant"])
def test_exchangeable_modes_cancel_on_the_shared_prefix(gen, loss, aggregation):
    prefix_grad, token_grad, res = run_case(gen, loss, aggregation, equal_lengths=False)
    assert token_grad > 1e-4, "the responses themselves do get a gradient"
    assert prefix_grad <= 1e-13 * token_grad  # zero up to float64 rounding
    assert res <= 1e-12


@pytest.mark.parametrize("loss", ["ppo", "linear"])
def test_seq_mean_token_mean_leaves_a_prefix_gradient_with_unequal_lengths(gen, loss):
    prefix_grad, _, res = run_case(gen, loss, "seq_mean_token_mean", equal_lengths=False)
    assert prefix_grad > 1e-8
    assert res > 1e-6


@pytest.mark.parametrize("loss", ["ppo", "linear"])
def test_seq_mean_token_mean_cancels_again_with_equal_lengths(gen, loss):
    prefix_grad, token_grad, res = run_case(gen, loss, "seq_mean_token_mean", equal_lengths=True)
    assert token_grad > 1e-4
    assert prefix_grad <= 1e-13 * token_grad  # zero up to float64 rounding
    assert res <= 1e-12
