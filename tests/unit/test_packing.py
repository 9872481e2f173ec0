"""Packed micro-batches (learner/micro_batch.py): several sequences to a row, kept apart by
their position_ids, give every sequence the statistics and gradients of a padded batch."""

import copy

import pytest
import torch

from groupflow.core.records import TrainSequence
from groupflow.learner.batching import pack_rows
from groupflow.learner.micro_batch import check_packing, model_inputs, response_token_stats
from groupflow.learner.token_head import install_token_head
from tests.unit.test_token_head import tiny_qwen2


def random_sequences(gen: torch.Generator, vocab: int, n: int) -> list[TrainSequence]:
    seqs = []
    for g in range(n):
        length = int(torch.randint(2, 30, (1,), generator=gen))
        prompt = int(torch.randint(1, length, (1,), generator=gen))
        ids = torch.randint(1, vocab, (length,), generator=gen).tolist()
        seqs.append(TrainSequence(ids, prompt, 0.0, g, 0, []))
    return seqs


@pytest.mark.parametrize("repeat", range(20))
def test_rows_hold_every_sequence_once_within_the_longest(gen, repeat):
    lengths = [
        int(torch.randint(1, 50, (1,), generator=gen))
        for _ in range(int(torch.randint(1, 40, (1,), generator=gen)))
    ]
    rows, starts, num_rows = pack_rows(lengths)
    width = max(lengths)
    cells = set()
    for row, start, length in zip(rows, starts, lengths, strict=True):
        assert 0 <= row < num_rows and 0 <= start and start + length <= width
        span = {(row, c) for c in range(start, start + length)}
        assert not span & cells, "two sequences overlap"
        cells |= span
    # First fit: a sequence went to a later row only because it did not fit an earlier one,
    # whose load only grew since; so any two rows together hold more than one row can (at
    # most one row is half empty, and never more than 2 x the optimum rows are used).
    loads = [0] * num_rows
    for row, length in zip(rows, lengths, strict=True):
        loads[row] += length
    assert all(loads[i] + loads[j] > width for i in range(num_rows) for j in range(i + 1, num_rows))


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-10), (torch.float32, 1e-6)])
def test_packed_statistics_and_gradients_equal_the_padded_batchs(gen, tied, dtype, tol):
    padded_model = tiny_qwen2(gen, tied, dtype)
    install_token_head(padded_model)
    packed_model = copy.deepcopy(padded_model)
    # Random lengths may leave every sequence a row of its own; draw until some share a row,
    # so that the comparison covers packing at all.
    for _ in range(100):
        seqs = random_sequences(gen, padded_model.config.vocab_size, 12)
        packed_inputs = model_inputs(seqs, torch.device("cpu"), packed=True)
        if packed_inputs.input_ids.shape[0] < len(seqs):
            break
    assert packed_inputs.input_ids.shape[0] < len(seqs), "a batch that packs into fewer rows"
    n_tokens = sum(len(s.input_ids) - s.prompt_len for s in seqs)
    w = torch.randn(n_tokens, generator=gen, dtype=dtype)
    results = []
    for model, packed in ((padded_model, False), (packed_model, True)):
        stats = response_token_stats(model, seqs, 0.7, torch.device("cpu"), True, packed)
        loss = (torch.cat([s.logp for s in stats]) * w).sum()
        loss = loss + torch.cat([s.entropy for s in stats]).sum()
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        results.append((stats, grads))
    (padded, padded_grads), (packed, packed_grads) = results
    for a, b in zip(padded, packed, strict=True):
        for field in ("logp", "entropy", "sum_p2"):
            torch.testing.assert_close(getattr(b, field), getattr(a, field), rtol=tol, atol=tol)
    for name, g in padded_grads.items():
        # a gradient sums over every token in another order: its rounding scales with the
        # largest entry, not with each entry (the exactness claim is float64's)
        scale = max(1.0, g.abs().max().item())
        torch.testing.assert_close(
            packed_grads[name], g, rtol=tol * 10, atol=tol * 10 * scale, msg=name
        )


class IgnoresPositionIds(torch.nn.Module):
    """A model whose attention knows nothing of packed sequences."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, position_ids=None, **kwargs):
        return self.model(**kwargs)


def test_a_model_that_lets_packed_sequences_see_each_other_is_refused(gen):
    model = tiny_qwen2(gen, tied=True, dtype=torch.float32)
    install_token_head(model)
    vocab = model.config.vocab_size
    check_packing(model, vocab, torch.device("cpu"))  # keeps them apart: passes
    with pytest.raises(
        ValueError, match=r"learner.pack_sequences: .* set learner.pack_sequences=false"
    ):
        check_packing(IgnoresPositionIds(model), vocab, torch.device("cpu"))
