import pytest
import torch

from groupflow.learner.token_stats import token_stats


@pytest.mark.parametrize("chunk", [1, 7, 1024])
def test_chunked_stats_equal_the_full_distribution(chunk):
    gen = torch.Generator().manual_seed(torch.seed())
    n, v, temperature = 23, 41, 0.7
    logits = torch.randn(n, v, generator=gen, dtype=torch.float64) * 3
    targets = torch.randint(0, v, (n,), generator=gen)
    stats = token_stats(logits, targets, temperature, chunk_size=chunk)
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    p = logp_all.exp()
    torch.testing.assert_close(stats.logp, logp_all[torch.arange(n), targets])
    torch.testing.assert_close(stats.entropy, -(p * logp_all).sum(-1))
    torch.testing.assert_close(stats.sum_p2, (p * p).sum(-1))


def test_low_precision_logits_give_float32_stats():
    logits = torch.randn(4, 9).to(torch.bfloat16)
    stats = token_stats(logits, torch.randint(0, 9, (4,)), 1.0)
    assert stats.logp.dtype == stats.entropy.dtype == stats.sum_p2.dtype == torch.float32


def test_logp_keeps_gradient_and_entropy_only_when_asked():
    logits = torch.randn(5, 9, requires_grad=True)
    targets = torch.randint(0, 9, (5,))
    plain = token_stats(logits, targets, 1.0)
    assert plain.logp.requires_grad and not plain.entropy.requires_grad
    with_entropy = token_stats(logits, targets, 1.0, entropy_grad=True)
    assert with_entropy.entropy.requires_grad
    with_entropy.entropy.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_split_gives_each_sequence_its_tokens():
    stats = token_stats(torch.randn(5, 7), torch.randint(0, 7, (5,)), 1.0)
    parts = stats.split([2, 0, 3])
    assert [len(p.logp) for p in parts] == [2, 0, 3]
    assert torch.equal(parts[2].entropy, stats.entropy[2:])
    assert torch.equal(parts[0].sum_p2, stats.sum_p2[:2])
