"""The token head's statistics in Triton kernels: the CUDA path of learner/token_head.py.

The chunked head (`_ChunkedHeadStats`) holds a chunk's [chunk, vocab] logits in float32 and
makes about ten elementwise passes over them. Here the forward kernel reads a block of hidden
states and the head weight a vocabulary tile at a time, multiplies them with float32
accumulation and folds each tile of logits into running per-token sums (an online
logsumexp): the [tokens, vocab] logits never exist. What comes out per token is the log-prob
of the target, the entropy, the sum of squared probabilities and the normaliser, which the
backward reuses.

Per token, with s_j = logit_j / T, running max m and over the tiles seen so far:
  z = sum_j exp(s_j - m)            (the normaliser is m + log z)
  a = sum_j exp(s_j - m) (s_j - m)  (the entropy is log z - a / z)
  q = sum_j exp(2 (s_j - m))        (sum_j p_j^2 is q / z^2)
all rescaled when m grows. Keeping a relative to m avoids the cancellation of m + log z -
sum_j p_j s_j at large logits.

The backward recomputes each tile's logits the same way and writes the logits' gradient in
the model's dtype, a chunk of tokens at a time: that is the operand of the two matmuls (to the
hidden states and to the weight) that follow, which cuBLAS does best.

Triton reads TRITON_INTERPRET when a kernel is defined (at import of this module): with it
set, the kernels run on the CPU through Triton's interpreter, which is how the tests check
them against the chunked head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from groupflow.learner.token_stats import stats_dtype


@dataclass(frozen=True)
class TileSizes:
    """Block sizes of the kernels (tl.dot needs 16 or more in each dimension)."""

    tokens: int = 64
    vocab: int = 128
    hidden: int = 64


GPU_TILES = TileSizes()


@triton.jit
def _logits_tile(
    h_ptr,
    w_ptr,
    rows,
    cols,
    n,
    v,
    d,
    stride_hn,
    stride_wv,
    inv_temperature,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """s = hidden[rows] @ weight[cols].T / T, float32 (or float64) accumulation, -inf past
    the vocabulary."""
    acc_dtype = tl.float64 if h_ptr.dtype.element_ty == tl.float64 else tl.float32
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=acc_dtype)
    # 64-bit offsets: a 256k vocabulary times a width of 8192 passes 2^31 elements
    h_rows = h_ptr + rows[:, None].to(tl.int64) * stride_hn
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wv
    for k in range(0, d, BLOCK_D):
        ks = k + tl.arange(0, BLOCK_D)
        h = tl.load(
            h_rows + ks[None, :],
            mask=(rows[:, None] < n) & (ks[None, :] < d),
            other=0.0,
        )
        w = tl.load(
            w_rows + ks[None, :],
            mask=(cols[:, None] < v) & (ks[None, :] < d),
            other=0.0,
        )
        if UPCAST:
            h, w = h.to(acc_dtype), w.to(acc_dtype)
        # ieee: float32 inputs would otherwise be multiplied in TF32 on GPUs (bf16's are exact)
        acc = tl.dot(h, tl.trans(w), acc, input_precision="ieee", out_dtype=acc_dtype)
    s = acc * inv_temperature
    return tl.where(cols[None, :] < v, s, float("-inf"))


@triton.jit
def _stats_forward_kernel(
    h_ptr,
    w_ptr,
    t_ptr,
    logp_ptr,
    entropy_ptr,
    sum_p2_ptr,
    lse_ptr,
    n,
    v,
    d,
    stride_hn,
    stride_wv,
    inv_temperature,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    targets = tl.load(t_ptr + rows, mask=rows < n, other=0)
    acc_dtype = tl.float64 if h_ptr.dtype.element_ty == tl.float64 else tl.float32
    m = tl.full((BLOCK_N,), float("-inf"), dtype=acc_dtype)
    z = tl.zeros((BLOCK_N,), dtype=acc_dtype)
    a = tl.zeros((BLOCK_N,), dtype=acc_dtype)
    q = tl.zeros((BLOCK_N,), dtype=acc_dtype)
    picked = tl.zeros((BLOCK_N,), dtype=acc_dtype)
    for start in range(0, v, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        s = _logits_tile(
            h_ptr, w_ptr, rows, cols, n, v, d, stride_hn, stride_wv, inv_temperature,
            BLOCK_N, BLOCK_V, BLOCK_D, UPCAST,
        )  # fmt: skip
        valid = cols[None, :] < v
        # Every tile holds a column of the vocabulary, so the new max is finite.
        m_new = tl.maximum(m, tl.max(s, axis=1))
        shift = m - m_new  # <= 0; -inf on the first tile, where z = a = q = 0
        scale = tl.where(z > 0, tl.exp(shift), 0.0)
        rel = tl.where(valid, s - m_new[:, None], 0.0)
        e = tl.where(valid, tl.exp(rel), 0.0)
        a = scale * (a + tl.where(z > 0, shift, 0.0) * z) + tl.sum(e * rel, axis=1)
        z = scale * z + tl.sum(e, axis=1)
        q = scale * scale * q + tl.sum(e * e, axis=1)
        m = m_new
        picked += tl.sum(tl.where(cols[None, :] == targets[:, None], s, 0.0), axis=1)
    log_z = tl.log(z)
    lse = m + log_z
    keep = rows < n
    tl.store(logp_ptr + rows, picked - lse, mask=keep)
    tl.store(entropy_ptr + rows, log_z - a / z, mask=keep)
    tl.store(sum_p2_ptr + rows, q / (z * z), mask=keep)
    tl.store(lse_ptr + rows, lse, mask=keep)


@triton.jit
def _logit_grad_kernel(
    h_ptr,
    w_ptr,
    t_ptr,
    lse_ptr,
    entropy_ptr,
    grad_logp_ptr,
    grad_entropy_ptr,
    out_ptr,
    n,
    v,
    d,
    stride_hn,
    stride_wv,
    stride_on,
    inv_temperature,
    HAS_LOGP: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """d loss / d logits of one (token block, vocabulary tile), into out (model dtype).

    d logp_y / d s = onehot(y) - p; d H / d s = -p (log p + H); s = logits / T."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    keep = rows < n
    s = _logits_tile(
        h_ptr, w_ptr, rows, cols, n, v, d, stride_hn, stride_wv, inv_temperature,
        BLOCK_N, BLOCK_V, BLOCK_D, UPCAST,
    )  # fmt: skip
    valid = (cols[None, :] < v) & keep[:, None]
    lse = tl.load(lse_ptr + rows, mask=keep, other=0.0)
    logp_all = tl.where(valid, s - lse[:, None], 0.0)
    p = tl.where(valid, tl.exp(logp_all), 0.0)
    grad = tl.zeros_like(p)
    if HAS_LOGP:
        g = tl.load(grad_logp_ptr + rows, mask=keep, other=0.0)
        targets = tl.load(t_ptr + rows, mask=keep, other=0)
        onehot = tl.where(cols[None, :] == targets[:, None], 1.0, 0.0)
        grad += g[:, None] * (onehot - p)
    if HAS_ENTROPY:
        g = tl.load(grad_entropy_ptr + rows, mask=keep, other=0.0)
        entropy = tl.load(entropy_ptr + rows, mask=keep, other=0.0)
        grad -= g[:, None] * p * (logp_all + entropy[:, None])
    grad = grad * inv_temperature
    tl.store(
        out_ptr + rows[:, None].to(tl.int64) * stride_on + cols[None, :],
        grad.to(out_ptr.dtype.element_ty),
        mask=(cols[None, :] < v) & keep[:, None],
    )


def _upcast(dtype: torch.dtype) -> bool:
    """Multiply half-precision tiles in float32? Only under Triton's interpreter, whose tl.dot
    (Triton 3.9) multiplies bfloat16 as the raw 16-bit integers numpy holds them in. Products of
    bf16 numbers are exact in float32, so this gives the tensor cores' numbers up to the order
    of summation."""
    return triton.knobs.runtime.interpret and dtype in (torch.bfloat16, torch.float16)


class FusedHeadStats(torch.autograd.Function):
    """(logp, entropy, sum_p2) of hidden @ weight.T / T: `_ChunkedHeadStats`'s interface and
    numbers, from the kernels above. `chunk` bounds the tokens of one backward logit-gradient
    block ([chunk, vocab] in the model's dtype)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, entropy_grad, tiles):
        hidden, weight = hidden.contiguous(), weight.contiguous()
        n, d = hidden.shape
        v = weight.shape[0]
        dtype = stats_dtype(hidden.dtype)
        logp, entropy, sum_p2, lse = (hidden.new_empty(n, dtype=dtype) for _ in range(4))
        if n:
            _stats_forward_kernel[(triton.cdiv(n, tiles.tokens),)](
                hidden, weight, targets, logp, entropy, sum_p2, lse,
                n, v, d, hidden.stride(0), weight.stride(0), 1.0 / temperature,
                BLOCK_N=tiles.tokens, BLOCK_V=tiles.vocab, BLOCK_D=tiles.hidden,
                UPCAST=_upcast(hidden.dtype),
            )  # fmt: skip
        ctx.temperature, ctx.chunk, ctx.tiles = temperature, chunk, tiles
        ctx.save_for_backward(hidden, weight, targets, lse, entropy if entropy_grad else None)
        ctx.mark_non_differentiable(sum_p2, *(() if entropy_grad else (entropy,)))
        ctx.set_materialize_grads(False)
        return logp, entropy, sum_p2

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, _grad_sum_p2):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None
        # Every parameter gets a gradient, even from no tokens: ZeRO-3 reduces collectively.
        grad_weight = torch.zeros_like(weight) if want_weight else None
        if grad_logp is None and grad_entropy is None:
            return grad_hidden, grad_weight, None, None, None, None, None
        n, d = hidden.shape
        v, tiles = weight.shape[0], ctx.tiles
        block = hidden.new_empty(min(ctx.chunk, n), v)
        for start in range(0, n, ctx.chunk):
            part = slice(start, start + ctx.chunk)
            rows = hidden[part].shape[0]
            grad_logits = block[:rows]
            _logit_grad_kernel[(triton.cdiv(rows, tiles.tokens), triton.cdiv(v, tiles.vocab))](
                hidden[part], weight, targets[part], lse[part],
                entropy[part] if grad_entropy is not None else lse,
                grad_logp[part].contiguous() if grad_logp is not None else lse,
                grad_entropy[part].contiguous() if grad_entropy is not None else lse,
                grad_logits, rows, v, d, hidden.stride(0), weight.stride(0),
                grad_logits.stride(0), 1.0 / ctx.temperature,
                HAS_LOGP=grad_logp is not None, HAS_ENTROPY=grad_entropy is not None,
                BLOCK_N=tiles.tokens, BLOCK_V=tiles.vocab, BLOCK_D=tiles.hidden,
                UPCAST=_upcast(hidden.dtype),
            )  # fmt: skip
            if want_hidden:
                torch.mm(grad_logits, weight, out=grad_hidden[part])
            if want_weight:
                grad_weight.addmm_(grad_logits.T, hidden[part])
        return grad_hidden, grad_weight, None, None, None, None, None
