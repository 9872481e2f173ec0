"""The routers of a mixture of experts on the learner: which experts the trained tokens go to
(the expert load of each layer, a step-record figure) and the load-balancing auxiliary loss,
`learner.moe.aux_loss_coef` (docs/moe.md, 'Expert load and the auxiliary loss').

transformers declares for each of its MoE models the module whose output holds the router
logits (`_can_record_outputs["router_logits"]`: Qwen3-MoE's `Qwen3MoeTopKRouter`, output 0).
`MoeRouting` hooks those modules and keeps their logits while a training forward records.
Under gradient checkpointing a layer's forward runs again in the backward; nothing records
then.

The loss of one layer over N trained positions is Switch Transformer's (arXiv 2101.03961,
eq. 4-6; transformers' load_balancing_loss_func for one layer):

    aux_l = E * sum_e f_le * P_le,   f_le = top-k assignments to expert e / N (no gradient),
                                     P_le = mean over the tokens of the router's p_lte
          = (1 / N) * sum_t E * sum_e f_le * p_lte

so a token's term is E * sum_e f_le p_lte, averaged over the layers. A micro-batch's terms are
summed over its trained tokens and divided by the mini-batch's global token count (all
micro-batches, all ranks), the policy loss's token_mean denominator, so every trained token
weighs the same however a step is cut. f is the micro-batch's own routing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor

from groupflow.config.base import ConfigError
from groupflow.config.learner import MoeConfig
from groupflow.core.records import TrainSequence
from groupflow.learner.credit import Reducer
from groupflow.learner.moe_blocks import config_has_experts
from groupflow.learner.token_head import ResponsePositions


def check_aux_loss(model_path: str, moe: MoeConfig) -> None:
    """ConfigError when the load-balancing loss is asked of a dense model (before any actor
    starts)."""
    if moe.aux_loss_coef > 0 and not config_has_experts(model_path):
        raise ConfigError(
            f"learner.moe.aux_loss_coef={moe.aux_loss_coef}: {model_path} is a dense model "
            "(its config counts no experts); the load-balancing loss needs a mixture of experts"
        )


@dataclass
class RoutedTokens:
    """A micro-batch's routing at its response positions, each weighted 1 where it is trained
    and 0 at an observation token (weights, not a selection: selecting by value would make
    the host wait for the device in every micro-batch)."""

    # per layer (N, E): the router's probabilities, with their graph when the loss is on
    probs: list[Tensor]
    weights: Tensor  # (N,) 1.0 trained, 0.0 not
    counts: Tensor  # (layers, E) float64: top-k assignments of trained tokens, no gradient

    @property
    def tokens(self) -> Tensor:
        """The trained tokens (a device tensor)."""
        return self.weights.sum()


def aux_loss_sum(routed: RoutedTokens) -> Tensor:
    """The sum over the trained tokens of E * sum_e f_le p_lte, averaged over the layers: N
    times the micro-batch's auxiliary loss (0 for no token)."""
    num_experts = routed.counts.shape[1]
    share = routed.counts / routed.tokens.to(routed.counts.dtype).clamp(min=1)  # f_le
    terms = [
        (p * routed.weights[:, None].to(p.dtype) * f.to(p.dtype)).sum()
        for p, f in zip(routed.probs, share, strict=True)
    ]
    return num_experts * torch.stack(terms).mean()


class MoeRouting:
    """The routers of one rank's policy, hooked to record their logits while a training
    forward runs (`recording`)."""

    def __init__(self, routers: list[torch.nn.Module], index: int, top_k: int, coef: float):
        self.top_k = top_k
        self.aux_loss_coef = coef
        self._index = index  # of the router logits in a router's output tuple
        self._recorded: list[Tensor] | None = None
        for router in routers:
            router.register_forward_hook(self._record)

    @classmethod
    def of(cls, model: torch.nn.Module, aux_loss_coef: float) -> MoeRouting | None:
        """The routing of `model` (a Hugging Face causal LM, before DeepSpeed wraps it); None
        for a model transformers declares no router logits of (a dense one)."""
        spec = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
        if spec is None:
            return None
        target = getattr(spec, "target_class", spec)
        routers = [m for m in model.modules() if isinstance(m, target)]
        if not routers:
            return None
        top_k = model.config.get_text_config().num_experts_per_tok
        return cls(routers, getattr(spec, "index", 0), top_k, aux_loss_coef)

    def _record(self, _module, _args, output) -> None:
        if self._recorded is not None:
            logits = output[self._index] if isinstance(output, tuple | list) else output
            self._recorded.append(logits)

    @contextmanager
    def recording(self) -> Iterator[list[Tensor]]:
        """Each router's logits (rows x width, E) of the forwards run inside, in layer order."""
        self._recorded = []
        try:
            yield self._recorded
        finally:
            self._recorded = None

    def at_positions(self, logits: list[Tensor], index: Tensor, weights: Tensor) -> RoutedTokens:
        """The routing of the flat positions `index` (row * width + column) of a forward,
        weighted by `weights` (1.0 trained, 0.0 not)."""
        probs, counts = [], []
        for layer in logits:
            z = layer.reshape(-1, layer.shape[-1])[index]
            if not self.aux_loss_coef:
                z = z.detach()  # a figure only: no graph kept
            p = torch.softmax(z.to(torch.promote_types(z.dtype, torch.float32)), dim=-1)
            chosen = torch.zeros_like(p, dtype=torch.float64)
            chosen.scatter_(1, p.detach().topk(self.top_k, dim=-1).indices, 1.0)
            counts.append((chosen * weights[:, None].to(torch.float64)).sum(0))
            probs.append(p)
        return RoutedTokens(probs, weights, torch.stack(counts))


def response_index(positions: ResponsePositions, width: int) -> Tensor:
    """The flat positions (row * width + column) that predict a response token: no prompt
    position and no padding."""
    return positions.rows * width + positions.cols


@dataclass
class MoeFigures:
    """A rank's routing sums of a step, over its trained tokens (each counted once)."""

    expert_tokens: list[list[float]] = field(default_factory=list)  # [layer][expert]
    aux_loss: float = 0.0  # sum over the tokens of their auxiliary-loss terms
    tokens: int = 0

    def merge(self, other: MoeFigures) -> MoeFigures:
        if not self.expert_tokens or not other.expert_tokens:
            return self if self.expert_tokens else other
        counts = [
            [a + b for a, b in zip(x, y, strict=True)]
            for x, y in zip(self.expert_tokens, other.expert_tokens, strict=True)
        ]
        return MoeFigures(counts, self.aux_loss + other.aux_loss, self.tokens + other.tokens)

    def record(self) -> dict:
        """The step record's keys (none for a dense model): per layer, the most tokens an
        expert got over the mean per expert (1 is perfect balance, E the worst), and the
        auxiliary loss per token."""
        if not self.expert_tokens:
            return {}
        balance = {}
        for layer, counts in enumerate(self.expert_tokens):
            mean = sum(counts) / len(counts)
            balance[str(layer)] = max(counts) / mean if mean else 0.0
        aux = self.aux_loss / self.tokens if self.tokens else 0.0
        return {"expert_load_max_over_mean": balance, "moe_aux_loss": aux}


class MiniBatchRouting:
    """A mini-batch's routing on one rank: each micro-batch's term of the loss, and the sums
    of its figures."""

    def __init__(self, coef: float, denominator: float, device: torch.device):
        self.coef = coef
        self.denominator = denominator
        self.counts: Tensor | None = None
        self.aux_loss = torch.zeros((), dtype=torch.float64, device=device)
        self.tokens = torch.zeros((), dtype=torch.float64, device=device)

    @classmethod
    def start(
        cls,
        routing: MoeRouting | None,
        micro_batches: list[list[TrainSequence]],
        reducer: Reducer,
        device: torch.device,
    ) -> MiniBatchRouting | None:
        """None for a dense model. With the loss on, the denominator is the mini-batch's model
        tokens over all ranks (a collective: every rank starts every mini-batch)."""
        if routing is None:
            return None
        denominator = 0.0
        if routing.aux_loss_coef:
            local = sum(s.num_model_tokens for mb in micro_batches for s in mb)
            total = reducer.sum(torch.tensor(float(local), dtype=torch.float64, device=device))
            denominator = float(total)
        return cls(routing.aux_loss_coef, denominator, device)

    def loss(self, routed: RoutedTokens | None, counted: bool) -> Tensor | float:
        """A micro-batch's term of the loss, coef * its tokens' terms / the global token
        count (0 with the loss off or no routing: an empty micro-batch); `counted`: its routing
        enters the figures (the first optimizer pass over it)."""
        if routed is None:
            return 0.0
        total = aux_loss_sum(routed)
        if counted:
            self.counts = routed.counts if self.counts is None else self.counts + routed.counts
            self.aux_loss += total.detach().to(torch.float64)
            self.tokens += routed.tokens.to(torch.float64)
        if not self.coef or not self.denominator:
            return 0.0
        return total * (self.coef / self.denominator)

    def figures(self) -> MoeFigures:
        """The sums, read from the device once."""
        if self.counts is None:
            return MoeFigures()
        layers, experts = self.counts.shape
        sums = torch.stack([self.aux_loss, self.tokens])
        host = torch.cat([self.counts.reshape(-1), sums]).tolist()  # one read
        counts = [host[i * experts : (i + 1) * experts] for i in range(layers)]
        return MoeFigures(counts, host[-2], round(host[-1]))
