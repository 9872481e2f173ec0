"""Rollout routing replay (R3) and the routing disagreement of a mixture of experts.

The engine returns the experts it routed each token to, per layer (rollout/engine.py); they
travel with the sequence (`TrainSequence.routed_experts`). A forward that runs on sequences
carrying them lays them out in the same grid as the token ids (`routing_grid`) and hands them
to the model's routers (`set_routing`), which then:

- count the (token, layer) pairs where the learner's own top-k set differs from the engine's
  (the routing disagreement), with the learner's top-k computed before any override; and
- with replay on (`learner.moe.routing_replay: rollout`), route each token to the engine's
  experts, with gate weights recomputed from the learner's own router logits by the model's
  rule: the softmax over all experts' logits taken at the chosen ones, renormalised over them
  when the model's `norm_topk_prob` says so (Qwen3-MoE's models do: then it is the softmax over
  the chosen experts' logits, R3's definition, and only their router rows get a gradient).

A position without the engine's routing (the last token of a sequence, which the engine never
ran through the model; a row's padding) keeps the learner's own routing and is not counted.

The routing stays set until the next forward sets another: a non-reentrant activation
checkpoint recomputes each layer during the backward, which must route as the forward did.
Each layer counts once per `set_routing`, so the recomputation adds nothing to the figure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from groupflow.config.base import ConfigError
from groupflow.core.errors import RunError
from groupflow.core.records import TrainSequence
from groupflow.learner.moe_blocks import moe_blocks


@dataclass
class RoutingGrid:
    """A micro-batch's engine routing in the model's input grid (R rows of W positions)."""

    experts: Tensor  # (R, W, layers, k) int64
    known: Tensor  # (R, W) bool: where the engine routed the token

    def columns(self, first: int, width: int) -> RoutingGrid:
        """A sequence-parallel shard's columns."""
        cols = slice(first, first + width)
        return RoutingGrid(self.experts[:, cols], self.known[:, cols])


@dataclass
class RoutingCounts:
    differing: int = 0  # (token, layer) pairs whose top-k sets differ
    pairs: int = 0  # (token, layer) pairs compared


class RoutingReplay:
    """The routers' state of one model: the routing to replay, and the disagreement counts."""

    def __init__(self, replay: bool, counting: bool):
        self.replay = replay
        self.counting = counting
        self.grid: RoutingGrid | None = None
        self._counted: set[int] = set()
        self.counts = RoutingCounts()

    def take_counts(self) -> RoutingCounts:
        """The counts since the last call."""
        counts, self.counts = self.counts, RoutingCounts()
        return counts

    def route(self, layer: int, logits: Tensor, scores: Tensor, indices: Tensor, norm: bool):
        """A router's output (logits, gate weights, expert indices of each token) under the
        current routing: counted, and replaced with the engine's where replay is on."""
        grid = self.grid
        if grid is None:
            return logits, scores, indices
        carried = grid.experts[:, :, layer].reshape(indices.shape)
        known = grid.known.reshape(-1)
        if carried.shape != indices.shape:
            raise RuntimeError(
                f"routing replay: layer {layer} routes {indices.shape[0]} tokens, the micro-batch "
                f"carries routing for {carried.shape[0]}"
            )
        if self.counting and layer not in self._counted:
            self._counted.add(layer)
            own, engine = indices.sort(dim=-1).values, carried.sort(dim=-1).values
            differs = (own != engine).any(dim=-1) & known
            self.counts.differing += int(differs.sum())
            self.counts.pairs += int(known.sum())
        if not self.replay:
            return logits, scores, indices
        chosen = torch.where(known[:, None], carried, indices)
        # at least float32, as the model's own router computes them
        dtype = torch.promote_types(logits.dtype, torch.float32)
        if norm:
            weights = torch.softmax(logits.gather(1, chosen), dim=-1, dtype=dtype)
        else:
            weights = torch.softmax(logits, dim=-1, dtype=dtype).gather(1, chosen)
        return logits, weights.to(logits.dtype), chosen

    def set(self, grid: RoutingGrid | None) -> None:
        self.grid = grid
        self._counted = set()


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def install_routing_replay(model: torch.nn.Module, replay: bool, counting: bool) -> bool:
    """Hook the routers of a mixture of experts (before deepspeed.initialize) so that forwards
    on sequences with the engine's routing count the disagreement and, with `replay`, replay
    it. False, and nothing installed, for a dense model; `replay` on one is refused."""
    blocks = {id(b) for b in moe_blocks(model)}
    if not blocks:
        if replay:
            raise ConfigError(
                "learner.moe.routing_replay: 'rollout' needs a mixture-of-experts model; "
                f"{type(model).__name__} has no expert blocks (set it to 'off')"
            )
        return False
    state = RoutingReplay(replay, counting)
    for name, block in model.named_modules():
        if id(block) not in blocks:
            continue
        router, layer = getattr(block, "gate", None), _LAYER.search(name + ".")
        if not (hasattr(router, "top_k") and hasattr(router, "norm_topk_prob")) or layer is None:
            if replay:
                raise ConfigError(
                    f"learner.moe.routing_replay: {type(block).__name__} ({name}) has no top-k "
                    "router of Qwen3-MoE's kind, the one replay supports (set it to 'off')"
                )
            return False
        router.register_forward_hook(_hook(state, int(layer.group(1)), router.norm_topk_prob))
    model.routing_replay = state
    return True


def check_replay_model(model_path: str, mode: str) -> None:
    """Before a job starts: routing replay, and the comparison of routings (`mode` 'rollout'
    or 'observe'), need a mixture of experts whose router is a top-k router of the Qwen-MoE
    kind (its config counts experts per token and says whether their weights are
    renormalised); ConfigError in one line otherwise."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path).get_text_config()
    if not all(
        getattr(config, key, None) is not None
        for key in ("num_experts", "num_experts_per_tok", "norm_topk_prob")
    ):
        raise ConfigError(
            f"learner.moe.routing_replay: {mode!r} needs a mixture of experts with a top-k "
            f"router of the Qwen-MoE kind; {model_path} ({config.model_type}) has none "
            "(set it to 'off')"
        )


def _hook(state: RoutingReplay, layer: int, norm: bool):
    def hook(module, args, output):
        return state.route(layer, *output, norm)

    return hook


def routing_state(model) -> RoutingReplay | None:
    """The routers' state of `model` (a Hugging Face model, or the DeepSpeed engine around
    one); None where none was installed."""
    # the DeepSpeed engine's module, or LoRA's reference (learner/lora.py AdaptersOff)'s model
    for m in (model, getattr(model, "module", None), getattr(model, "model", None)):
        state = getattr(m, "routing_replay", None)
        if isinstance(state, RoutingReplay):
            return state
    return None


def routing_grid(
    routed: list[np.ndarray | None], rows: list[int], starts: list[int], width: int, num_rows: int
) -> RoutingGrid | None:
    """The sequences' routing (each (tokens, layers, k), for its first tokens) laid out as
    their ids are: sequence i at row rows[i] from column starts[i]. None where none carries any."""
    present = [r for r in routed if r is not None]
    if not present:
        return None
    layers, k = present[0].shape[1:]
    experts = torch.zeros(num_rows, width, layers, k, dtype=torch.long)
    known = torch.zeros(num_rows, width, dtype=torch.bool)
    for r, row, start in zip(routed, rows, starts, strict=True):
        if r is not None and len(r):
            experts[row, start : start + len(r)] = torch.from_numpy(r.astype(np.int64))
            known[row, start : start + len(r)] = True
    return RoutingGrid(experts, known)


def check_routing(seqs: list[TrainSequence]) -> None:
    """Raise, in one line, unless every sequence carries the engine's routing of each token
    its trained tokens follow (a trajectory's trailing observation, which nothing trained
    follows and no request ran, may lack it): what replay needs."""
    for seq in seqs:
        have = 0 if seq.routed_experts is None else len(seq.routed_experts)
        if have < _routing_needed(seq):
            raise RunError(
                f"learner.moe.routing_replay: a sequence of group {seq.group_id} came without "
                f"the engine's routing of its tokens ({have} of {_routing_needed(seq)} "
                "routed): the engines did not return it"
            )


def _routing_needed(seq: TrainSequence) -> int:
    """The positions before the sequence's last trained token."""
    mask = seq.loss_mask or [1] * seq.num_response_tokens
    last = max((i for i, m in enumerate(mask) if m), default=0)
    return seq.prompt_len + last
