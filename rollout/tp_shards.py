"""Which part of each tensor of a sync a tensor-parallel worker loads, and the shard that stands
in for the whole tensor inside vLLM's weight loaders.

vLLM (0.32) loads a tensor-parallel model from whole Hugging Face tensors: each parameter's
weight loader cuts its worker's part out of the whole with one `narrow` along the split
dimension (column-parallel layers along the output, row-parallel ones along the input, the
vocabulary's rows for the embedding and the head). The engine's process cuts those parts here
(`shard_plan`), so that a worker receives its part only, and hands it to the loaders as a
`ShardOfTensor`: it has the whole tensor's shape (on the meta device, no memory), and narrowing
it to the worker's part gives the part. A loader that narrows anywhere else finds the plan
wrong and fails the load naming the tensor, rather than loading the wrong rows.

The plan knows the layers of the dense decoders groupflow trains (Qwen2/Qwen3, Llama: q/k/v,
o, gate/up, down projections, the embedding and the head) and the experts of Qwen-MoE, whose
loaders cut the same way; any other tensor (norms, the router) is replicated: every worker
receives it whole, as vLLM's loaders copy it whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# name suffix -> the dimension split: the output (column-parallel) or the input (row-parallel)
_COLUMN = ("q_proj", "gate_proj", "up_proj")
_KEY_VALUE = ("k_proj", "v_proj")
_ROW = ("o_proj", "down_proj")
_VOCAB = ("embed_tokens", "lm_head")


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of the model: its key/value heads and vocabulary."""

    num_key_value_heads: int
    vocab_size: int

    @classmethod
    def of(cls, config: dict) -> ModelShape:
        """From a model's config.json (a multimodal model's text part)."""
        text = config.get("text_config", config)
        heads = text["num_attention_heads"]
        return cls(text.get("num_key_value_heads") or heads, text["vocab_size"])


@dataclass(frozen=True)
class Split:
    """A worker's part of a tensor: `length` elements of dimension `dim` from `start`."""

    dim: int
    start: int
    length: int

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.narrow(self.dim, self.start, self.length)


def shard_plan(name: str, shape: tuple[int, ...], model: ModelShape, tp: int) -> list[Split] | None:
    """Each of `tp` workers' part of tensor `name` of `shape`, by worker; None: every worker
    loads it whole."""
    module, _, kind = name.rpartition(".")
    layer = module.rpartition(".")[2]
    if tp == 1 or not shape:
        return None
    if layer in _VOCAB and kind == "weight":
        return [_vocab_rows(model.vocab_size, rank, tp) for rank in range(tp)]
    if layer in _COLUMN:
        return _even(shape, 0, tp, tp)
    if layer in _KEY_VALUE:
        # fewer key/value heads than workers: each head is replicated on tp/heads workers
        heads = model.num_key_value_heads
        return _even(shape, 0, min(heads, tp), tp)
    if layer in _ROW and kind == "weight":  # a row-parallel bias is added once, whole
        return _even(shape, 1, tp, tp)
    return None


def _even(shape: tuple[int, ...], dim: int, parts: int, tp: int) -> list[Split]:
    """`shape[dim]` cut in `parts` equal parts, worker r holding part r * parts // tp."""
    length = shape[dim] // parts
    return [Split(dim, rank * parts // tp * length, length) for rank in range(tp)]


def _vocab_rows(vocab_size: int, rank: int, tp: int) -> Split:
    """The rows of the vocabulary vLLM's VocabParallelEmbedding gives worker `rank`: the
    vocabulary padded to its padding size, cut evenly, less the padding."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        DEFAULT_VOCAB_PADDING_SIZE,
        pad_vocab_size,
        vocab_range_from_global_vocab_size,
    )

    padded = pad_vocab_size(vocab_size, DEFAULT_VOCAB_PADDING_SIZE)
    start, end = vocab_range_from_global_vocab_size(padded, rank, tp)
    start, end = min(start, vocab_size), min(end, vocab_size)
    return Split(0, start, end - start)


class ShardOfTensor(torch.Tensor):
    """A worker's part of a tensor posing as the whole (module doc): the whole tensor's shape,
    dtype and no storage; `narrow` to the part gives the part, any other `narrow` fails."""

    @staticmethod
    def __new__(cls, part: torch.Tensor, name: str, shape: tuple[int, ...], split: Split):
        pose = torch.empty(shape, dtype=part.dtype, device="meta")
        self = torch.Tensor._make_subclass(cls, pose)
        self.part, self.tensor_name, self.split = part, name, split
        return self

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.narrow, torch.narrow) and isinstance(args[0], ShardOfTensor):
            self, *where = args
            dim, start, length = [*where, *kwargs.values()]
            if (dim % self.ndim, int(start), int(length)) != (
                self.split.dim,
                self.split.start,
                self.split.length,
            ):
                raise ValueError(
                    f"tensor-parallel load of {self.tensor_name}: vLLM's loader takes "
                    f"dim {dim} [{start}, +{length}), this worker received {self.split}"
                )
            return self.part
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
