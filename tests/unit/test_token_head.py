import copy

import pytest
import torch

from groupflow.core.random_model import random_causal_lm
from groupflow.learner.token_head import (
    install_token_head,
    response_positions,
    response_token_stats,
)
from groupflow.learner.token_stats import token_stats


def tiny_qwen2(gen: torch.Generator, tied: bool, dtype: torch.dtype):
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    model = random_causal_lm(53, seed=seed, tie_word_embeddings=tied).to(dtype)
    with torch.no_grad():  # weights large enough that the softmax is far from uniform
        for p in model.parameters():
            p.normal_(0, 0.5, generator=gen)
    model.config.use_cache = False
    return model


def padded_batch(gen: torch.Generator, vocab: int, n: int):
    lengths = [int(torch.randint(2, 12, (1,), generator=gen)) for _ in range(n)]
    prompts = [int(torch.randint(1, length, (1,), generator=gen)) for length in lengths]
    ids = torch.zeros(n, max(lengths), dtype=torch.long)
    attention = torch.zeros_like(ids)
    for r, length in enumerate(lengths):
        ids[r, :length] = torch.randint(0, vocab, (length,), generator=gen)
        attention[r, :length] = 1
    return ids, attention, lengths, prompts


def full_logits_stats(model, ids, attention, positions, temperature, entropy_grad):
    """Today's path: the logits of every position, then the response positions' stats."""
    logits = model(input_ids=ids, attention_mask=attention).logits
    picked = logits[positions.rows, positions.cols]
    return token_stats(picked, positions.targets, temperature, entropy_grad=entropy_grad)


def grads_of(model, stats, w_logp, w_entropy):
    model.zero_grad(set_to_none=True)
    loss = (w_logp * stats.logp).sum()
    if w_entropy is not None:
        loss = loss + (w_entropy * stats.entropy).sum()
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize(
    # float32 gradients: 1e-4 of the parameter's largest gradient. A small parameter's
    # gradient (a norm weight, a bias) is a sum of terms that largely cancel, so its rounding
    # error is relative to the terms, not to the result: up to 2.3e-5 of its largest entry was
    # seen over 600 seeded cases (GROUPFLOW_TEST_SEED=708247270 exceeded 1e-5). A chunk summed
    # wrong is off by the order of the gradient itself.
    ("dtype", "tol", "grad_tol"),
    [(torch.float64, 1e-10, 1e-10), (torch.float32, 1e-6, 1e-4)],
)
def test_head_stats_and_gradients_equal_the_full_logits_path(
    gen, tied, entropy_grad, dtype, tol, grad_tol
):
    reference = tiny_qwen2(gen, tied, dtype)
    model = copy.deepcopy(reference)
    names = [name for name, _ in model.named_parameters()]
    vocab = reference.config.vocab_size
    # 3 tokens per chunk: many chunks, the last one partial
    install_token_head(model, chunk_elements=3 * vocab)
    assert [name for name, _ in model.named_parameters()] == names
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    ids, attention, lengths, prompts = padded_batch(gen, vocab, 4)
    positions = response_positions(ids, lengths, prompts)
    temperature = 0.7
    want = full_logits_stats(reference, ids, attention, positions, temperature, entropy_grad)
    got = response_token_stats(model, ids, attention, positions, temperature, entropy_grad)
    for field in ("logp", "entropy", "sum_p2"):
        torch.testing.assert_close(getattr(got, field), getattr(want, field), rtol=tol, atol=tol)
    assert got.logp.requires_grad and not got.sum_p2.requires_grad
    assert got.entropy.requires_grad == entropy_grad
    w_logp = torch.randn(got.logp.shape, generator=gen, dtype=got.logp.dtype)
    w_entropy = torch.randn(got.logp.shape, generator=gen, dtype=got.logp.dtype)
    w_entropy = w_entropy if entropy_grad else None
    want_grads = grads_of(reference, want, w_logp, w_entropy)
    got_grads = grads_of(model, got, w_logp, w_entropy)
    for name in names:
        # The chunks sum in another order: the gradients agree to rounding (grad_tol above).
        scale = want_grads[name].abs().max().item()
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=0, atol=grad_tol * scale)


def test_entropy_gradient_alone(gen):
    reference = tiny_qwen2(gen, True, torch.float64)
    model = copy.deepcopy(reference)
    install_token_head(model, chunk_elements=5 * reference.config.vocab_size)
    ids, attention, lengths, prompts = padded_batch(gen, reference.config.vocab_size, 3)
    positions = response_positions(ids, lengths, prompts)
    want = full_logits_stats(reference, ids, attention, positions, 1.3, True)
    got = response_token_stats(model, ids, attention, positions, 1.3, entropy_grad=True)
    model.zero_grad()
    reference.zero_grad()
    got.entropy.sum().backward()
    want.entropy.sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-10, msg=name)


def test_no_response_tokens_still_gives_every_parameter_a_gradient(gen):
    """An empty micro-batch's zero loss must reach every parameter (ZeRO-3 reduces
    gradients collectively)."""
    model = tiny_qwen2(gen, True, torch.float64)
    install_token_head(model)
    ids = torch.zeros(1, 1, dtype=torch.long)
    positions = response_positions(ids, [], [])
    stats = response_token_stats(model, ids, torch.ones_like(ids), positions, 1.0)
    assert stats.logp.shape == (0,)
    (stats.logp.sum() * 0.0).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and not p.grad.any(), name


def test_without_positions_the_model_still_returns_logits(gen):
    reference = tiny_qwen2(gen, False, torch.float64)
    model = copy.deepcopy(reference)
    install_token_head(model)
    ids, attention, _, _ = padded_batch(gen, reference.config.vocab_size, 2)
    torch.testing.assert_close(
        model(input_ids=ids, attention_mask=attention).logits,
        reference(input_ids=ids, attention_mask=attention).logits,
    )


def test_packed_positions_select_each_response_and_its_next_tokens():
    ids = torch.tensor([[10, 11, 12, 13, 20, 21, 22], [30, 31, 32, 0, 0, 0, 0]])
    # row 0 holds (10 11 | 12 13) then (20 | 21 22); row 1 holds (30 31 | 32)
    got = response_positions(ids, [4, 3, 3], [2, 1, 2], rows=[0, 0, 1], starts=[0, 4, 0])
    assert got.rows.tolist() == [0, 0, 0, 0, 1]
    assert got.cols.tolist() == [1, 2, 4, 5, 1]
    assert got.targets.tolist() == [12, 13, 21, 22, 32]
    assert got.sizes == [2, 2, 1]


@pytest.mark.parametrize(("length", "prompt", "start"), [(3, 0, 0), (3, 4, 0), (5, 1, 3)])
def test_a_sequence_that_does_not_fit_is_named(length, prompt, start):
    ids = torch.zeros(2, 6, dtype=torch.long)
    with pytest.raises(ValueError, match="sequence 1"):
        response_positions(ids, [2, length], [1, prompt], rows=[0, 1], starts=[0, start])


def test_a_head_with_bias_is_refused(gen):
    model = tiny_qwen2(gen, False, torch.float32)
    model.lm_head = torch.nn.Linear(16, 53, bias=True)
    with pytest.raises(ValueError, match="bias-free"):
        install_token_head(model)
