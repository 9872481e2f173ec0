"""The fused token head (learner/fused_token_head.py) against the chunked head, its reference,
on fresh random inputs. The fused head runs under Triton's interpreter in a subprocess
(tests/unit/fused_head_worker.py says why); the references run here."""

import os
import subprocess
import sys

import pytest
import torch

from groupflow.learner.token_head import (
    _ChunkedHeadStats,
    head_stats_function,
    install_token_head,
    response_positions,
    response_token_stats,
)
from groupflow.learner.token_stats import TokenStats
from tests.unit.test_token_head import padded_batch, tiny_qwen2

# Kernels tiles of 16 against vocabularies and widths that are not multiples of 16, chunks
# of 10 tokens against 37 tokens: partial tiles and chunks everywhere.
TILES = (16, 16, 16)
HEAD_CASES = [  # (name, dtype, vocab, width, temperature, entropy_grad)
    ("float64", torch.float64, 53, 20, 1.0, False),
    ("float64_tempered_entropy_grad", torch.float64, 70, 40, 0.6, True),
    ("float64_hot", torch.float64, 53, 20, 1.7, True),
    ("float32", torch.float32, 53, 20, 0.8, True),
    ("bfloat16", torch.bfloat16, 53, 20, 0.8, True),
]
MODEL_CASES = [True, False]  # tied embeddings or not


def head_inputs(gen: torch.Generator, dtype, vocab, width, temperature, entropy_grad) -> dict:
    n = 37
    stats = torch.promote_types(dtype, torch.float32)
    return {
        # hidden states large enough that the softmax is far from uniform
        "hidden": (2 * torch.randn(n, width, generator=gen, dtype=torch.float64)).to(dtype),
        "weight": torch.randn(vocab, width, generator=gen, dtype=torch.float64).to(dtype),
        "targets": torch.randint(0, vocab, (n,), generator=gen),
        "temperature": temperature,
        "chunk": 10,
        "entropy_grad": entropy_grad,
        "tiles": TILES,
        "w_logp": torch.randn(n, generator=gen, dtype=torch.float64).to(stats),
        "w_entropy": torch.randn(n, generator=gen, dtype=torch.float64).to(stats),
    }


def model_case_stats(seed: int, tied: bool) -> tuple[torch.nn.Module, TokenStats]:
    """A float64 tiny Qwen2 with the token head, and its statistics of a padded batch whose
    sequences (and responses) differ in length, at temperature 0.7 with entropy gradients."""
    gen = torch.Generator().manual_seed(seed)
    model = tiny_qwen2(gen, tied, torch.float64)
    install_token_head(model, chunk_elements=5 * model.config.vocab_size)
    ids, attention, lengths, prompts = padded_batch(gen, model.config.vocab_size, 5)
    positions = response_positions(ids, lengths, prompts)
    return model, response_token_stats(model, ids, attention, positions, 0.7, entropy_grad=True)


def model_case_loss(seed: int, stats: TokenStats) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    w = torch.randn(2, stats.logp.shape[0], generator=gen, dtype=torch.float64)
    return (w[0] * stats.logp).sum() + (w[1] * stats.entropy).sum()


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    """Fresh random cases, and the fused head's results of them from one subprocess."""
    seed = int(torch.randint(0, 2**31, (1,)))
    print(f"seed={seed}")
    gen = torch.Generator().manual_seed(seed)
    cases = {
        "heads": [head_inputs(gen, *case[1:]) for case in HEAD_CASES],
        "models": [(seed + 2 * i, tied) for i, tied in enumerate(MODEL_CASES)],
    }
    folder = tmp_path_factory.mktemp("fused_head")
    torch.save(cases, folder / "cases.pt")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.unit.fused_head_worker",
            folder / "cases.pt",
            folder / "out.pt",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # tiny tensors (tests/unit/conftest.py)
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return cases, torch.load(folder / "out.pt")


def chunked_head(case: dict, dtype: torch.dtype) -> dict:
    """The reference: the chunked head on the same inputs in `dtype`."""
    hidden = case["hidden"].to(dtype).requires_grad_()
    weight = case["weight"].to(dtype).requires_grad_()
    stats = _ChunkedHeadStats.apply(
        hidden, weight, case["targets"], case["temperature"], case["chunk"], case["entropy_grad"]
    )
    loss = (case["w_logp"].to(dtype) * stats[0]).sum()
    if case["entropy_grad"]:
        loss = loss + (case["w_entropy"].to(dtype) * stats[1]).sum()
    loss.backward()
    return {"stats": [s.detach() for s in stats], "hidden": hidden.grad, "weight": weight.grad}


@pytest.mark.parametrize("index", range(len(HEAD_CASES)), ids=[c[0] for c in HEAD_CASES])
def test_fused_head_equals_the_chunked_head(fused, index):
    cases, out = fused
    case, got = cases["heads"][index], out["heads"][index]
    dtype = HEAD_CASES[index][1]
    if dtype == torch.float64:  # exact up to rounding
        ref, tol, grad_tol = chunked_head(case, torch.float64), 1e-10, 1e-10
    elif dtype == torch.float32:  # float32 rounding of logits up to about 40
        ref, tol, grad_tol = chunked_head(case, torch.float32), 1e-4, 1e-4
    else:
        # bf16 inputs, float32 accumulation: close to float64 statistics of the same inputs;
        # the gradients are bf16 (the matmuls' operands), good to bf16's 8 bits.
        ref, tol, grad_tol = chunked_head(case, torch.float64), 1e-4, 0.05
    assert got["stats"][0].dtype == torch.promote_types(dtype, torch.float32)
    for name, g, r in zip(("logp", "entropy", "sum_p2"), got["stats"], ref["stats"], strict=True):
        torch.testing.assert_close(g.to(r.dtype), r, rtol=tol, atol=tol, msg=name)
    for name in ("hidden", "weight"):
        r = ref[name]
        scale = r.abs().max()
        torch.testing.assert_close(
            got[name].to(r.dtype) / scale, r / scale, rtol=grad_tol, atol=grad_tol, msg=name
        )


@pytest.mark.parametrize("index", range(len(MODEL_CASES)), ids=["tied", "untied"])
def test_fused_head_in_a_model_equals_the_chunked_head(fused, index):
    """Through a whole float64 model (tied embeddings or not), temperature 0.7, sequences of
    different lengths: statistics and every parameter's gradient."""
    cases, out = fused
    assert out["fused_calls"] >= 2 * len(MODEL_CASES)  # the CUDA selection is the fused head
    seed, _ = cases["models"][index]
    got = out["models"][index]
    model, stats = model_case_stats(seed, MODEL_CASES[index])
    assert head_stats_function(next(model.parameters()).device) == _ChunkedHeadStats.apply
    model_case_loss(seed, stats).backward()
    for g, r in zip(got["stats"], (stats.logp, stats.entropy, stats.sum_p2), strict=True):
        torch.testing.assert_close(g, r.detach(), rtol=1e-10, atol=1e-10)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got["grads"][name], p.grad, rtol=1e-10, atol=1e-10, msg=name)
