"""Token statistics straight from hidden states, without a micro-batch's logits.

At a 150k vocabulary the [batch, width, vocab] logits are by far the learner's largest
activation. Here only the response-predicting positions are projected, a chunk of tokens at
a time, and the backward recomputes each chunk's logits instead of keeping them: what is
saved for backward is the (N, H) hidden states and a few numbers per token.

Under DeepSpeed ZeRO-3 the head's weight is a partitioned parameter, gathered only around
the forward (and, through DeepSpeed's hooks, the backward) of the module that owns it. So the
statistics are computed inside the forward of `TokenHead`, which replaces the model's lm head
and owns the same weight Parameter (a tied head stays tied; parameter names do not change),
and the model's forward calls it when given `response_positions`.

On CUDA the statistics come from fused Triton kernels (learner/fused_token_head.py) that never
hold a chunk's logits; the chunked head here is the CPU path and their reference.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from groupflow.core.device import to_device
from groupflow.learner.token_stats import TokenStats, stats_dtype

# Elements of one chunk's [chunk, vocab] logits: 2^27 float32 values are 512 MiB, about 880
# tokens at a 150k vocabulary; forward and backward each hold a few such buffers at a time.
DEFAULT_CHUNK_ELEMENTS = 1 << 27


@dataclass
class ResponsePositions:
    """The positions of a padded or packed batch whose next token is a response token."""

    rows: torch.Tensor  # (N,) batch row of each position
    cols: torch.Tensor  # (N,) column of each position; column t predicts the token at t + 1
    targets: torch.Tensor  # (N,) the token each position predicts
    sizes: list[int]  # response tokens of each sequence, in order (they sum to N)


def response_positions(
    input_ids: torch.Tensor,
    lengths: list[int],
    prompt_lens: list[int],
    rows: list[int] | None = None,
    starts: list[int] | None = None,
) -> ResponsePositions:
    """input_ids (B, W) holding sequence i (`lengths[i]` tokens, the first `prompt_lens[i]`
    of them prompt) at row `rows[i]` from column `starts[i]`; by default one sequence per
    row from column 0 (a padded batch). Several sequences may share a row (a packed batch)."""
    rows = list(range(len(lengths))) if rows is None else rows
    starts = [0] * len(lengths) if starts is None else starts
    if not len(rows) == len(starts) == len(prompt_lens) == len(lengths):
        raise ValueError("response_positions: lengths, prompt_lens, rows and starts differ in size")
    width = input_ids.shape[1]
    row_parts, col_parts, sizes = [], [], []
    for i, (row, start, length, prompt) in enumerate(
        zip(rows, starts, lengths, prompt_lens, strict=True)
    ):
        if not 1 <= prompt <= length or start < 0 or start + length > width:
            raise ValueError(
                f"response_positions: sequence {i} (start {start}, length {length}, "
                f"prompt {prompt}) does not fit a batch of width {width}"
            )
        cols = torch.arange(start + prompt - 1, start + length - 1)
        row_parts.append(torch.full_like(cols, row))
        col_parts.append(cols)
        sizes.append(length - prompt)
    empty = torch.zeros(0, dtype=torch.long)
    rows_t = torch.cat(row_parts) if row_parts else empty
    cols_t = torch.cat(col_parts) if col_parts else empty
    rows_t, cols_t = (to_device(t, input_ids.device) for t in (rows_t, cols_t))
    return ResponsePositions(rows_t, cols_t, input_ids[rows_t, cols_t + 1], sizes)


class TokenHead(torch.nn.Module):
    """A bias-free lm head that also yields token statistics, a chunk of tokens at a time."""

    def __init__(self, weight: torch.nn.Parameter, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS):
        super().__init__()
        self.weight = weight  # (V, H), the very Parameter of the head it replaces
        self.chunk_elements = chunk_elements

    def forward(
        self,
        hidden: torch.Tensor,
        targets: torch.Tensor | None = None,
        temperature: float = 1.0,
        entropy_grad: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden (..., H) alone -> logits (..., V), as the replaced head did. With targets:
        hidden (N, H), targets (N,) -> (logp, entropy, sum_p2), each (N,). A tuple rather than
        a TokenStats because DeepSpeed hooks its backward onto the tensors of tuples only."""
        if targets is None:
            return F.linear(hidden, self.weight)
        chunk = max(1, self.chunk_elements // self.weight.shape[0])
        head_stats = head_stats_function(hidden.device)
        return head_stats(hidden, self.weight, targets, float(temperature), chunk, entropy_grad)


def head_stats_function(device: torch.device):
    """The head's statistics on `device`: fused Triton kernels on CUDA
    (learner/fused_token_head.py), the chunked head, their reference, elsewhere. Both take
    (hidden, weight, targets, temperature, chunk, entropy_grad) -> (logp, entropy, sum_p2)."""
    if device.type != "cuda":
        return _ChunkedHeadStats.apply
    from groupflow.learner.fused_token_head import GPU_TILES, FusedHeadStats

    return lambda *args: FusedHeadStats.apply(*args, GPU_TILES)


def install_token_head(
    model: torch.nn.Module, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS
) -> TokenHead:
    """Give a Hugging Face causal LM a TokenHead in place of its lm head (before
    deepspeed.initialize). Afterwards `model(input_ids=..., attention_mask=...,
    response_positions=P, temperature=T, entropy_grad=b)` returns (logp, entropy, sum_p2) of
    P's tokens (see `response_token_stats`); without `response_positions` it is the plain model."""
    head = model.get_output_embeddings()
    if isinstance(head, TokenHead):
        return head
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        raise ValueError(
            f"install_token_head: {type(model).__name__}'s lm head is {head!r}; "
            "only a bias-free Linear head is supported"
        )
    token_head = TokenHead(head.weight, chunk_elements)
    model.set_output_embeddings(token_head)
    model.forward = types.MethodType(_forward_with_token_head, model)
    return token_head


def response_token_stats(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    positions: ResponsePositions,
    temperature: float,
    entropy_grad: bool = False,
    position_ids: torch.Tensor | None = None,
) -> TokenStats:
    """TokenStats of `positions` (on the model's device) through a model with a TokenHead, or
    through the DeepSpeed model wrapping it. Gradients flow to logp (and entropy if asked).
    A packed batch passes `position_ids` (restarting at each sequence) and no attention mask."""
    return TokenStats(
        *model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            response_positions=positions,
            temperature=temperature,
            entropy_grad=entropy_grad,
        )
    )


def _forward_with_token_head(
    self,
    *args,
    response_positions: ResponsePositions | None = None,
    temperature: float = 1.0,
    entropy_grad: bool = False,
    **kwargs,
):
    if response_positions is None:
        return type(self).forward(self, *args, **kwargs)
    hidden = self.base_model(*args, **kwargs).last_hidden_state
    p = response_positions
    return self.get_output_embeddings()(
        hidden[p.rows, p.cols], p.targets, temperature, entropy_grad
    )


def _chunk_log_probs(
    hidden: torch.Tensor, weight: torch.Tensor, temperature: float, lse: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden (n, H) -> log-probs (n, V) of the tempered distribution and their normaliser
    (n,). The projection runs in the model's dtype, the softmax in at least float32; a given
    `lse` is reused (backward) instead of recomputed."""
    scaled = (hidden @ weight.T).to(stats_dtype(hidden.dtype)).div_(temperature)
    if lse is None:
        lse = torch.logsumexp(scaled, dim=-1)
    return scaled.sub_(lse[:, None]), lse


class _ChunkedHeadStats(torch.autograd.Function):
    """(logp, entropy, sum_p2) of hidden @ weight.T / T, one chunk of tokens at a time; the
    backward recomputes each chunk's logits, so no more than one chunk's exist at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, entropy_grad):
        n, dtype = hidden.shape[0], stats_dtype(hidden.dtype)
        logp, entropy, sum_p2, lse = (hidden.new_empty(n, dtype=dtype) for _ in range(4))
        for start in range(0, n, chunk):
            part = slice(start, start + chunk)
            logp_all, lse[part] = _chunk_log_probs(hidden[part], weight, temperature)
            logp[part] = logp_all.gather(-1, targets[part, None]).squeeze(-1)
            p = logp_all.exp()
            entropy[part] = -(p * logp_all).sum(-1)
            sum_p2[part] = (p * p).sum(-1)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.save_for_backward(hidden, weight, targets, lse, entropy if entropy_grad else None)
        ctx.mark_non_differentiable(sum_p2, *(() if entropy_grad else (entropy,)))
        ctx.set_materialize_grads(False)
        return logp, entropy, sum_p2

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, _grad_sum_p2):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None
        # Every parameter must get a gradient, even from an empty micro-batch: ZeRO-3 reduces
        # gradients collectively, so every rank must contribute one for every parameter.
        grad_weight = torch.zeros_like(weight) if want_weight else None
        if grad_logp is None and grad_entropy is None:
            return grad_hidden, grad_weight, None, None, None, None
        for start in range(0, hidden.shape[0], ctx.chunk):
            part = slice(start, start + ctx.chunk)
            logp_all, _ = _chunk_log_probs(hidden[part], weight, ctx.temperature, lse[part])
            p = logp_all.exp()
            # d/ds of logp_y is onehot(y) - p; of the entropy H it is -p (log p + H);
            # s = logits / T, so the logits' gradient is that over T.
            if grad_entropy is not None:
                grad_s = logp_all.add_(entropy[part, None]).mul_(p).mul_(-grad_entropy[part, None])
                if grad_logp is not None:
                    grad_s.addcmul_(p, grad_logp[part, None], value=-1)
            else:
                grad_s = p.mul_(-grad_logp[part, None])
            if grad_logp is not None:
                grad_s.scatter_add_(-1, targets[part, None], grad_logp[part, None])
            grad_logits = grad_s.div_(ctx.temperature).to(hidden.dtype)
            if want_hidden:
                grad_hidden[part] = grad_logits @ weight
            if want_weight:
                grad_weight.addmm_(grad_logits.T, hidden[part])
        return grad_hidden, grad_weight, None, None, None, None
