"""One rank's share of a learner step: proximal statistics, then per mini-batch its credit
plan and one optimizer update per pass of the plan (docs/algorithms.md,
'Aggregation', 'Token-credit transforms', 'Diagnostics').

`minibatches[m][k]` is this rank's k-th micro-batch of mini-batch m. Every rank runs the same
number of micro-batches in a mini-batch (learner/batching.py), a rank with less work getting
empty ones, so all ranks take the same branches below and make their collectives (ZeRO-3's
parameter gathers, the credit plan's reductions) in the same order.

"Proximal statistics" are the learner's own at the weights the step starts from (old_logp):
the proximal policy of the off-policy correction (learner/off_policy.py). The sampler's
log-probs, the behaviour policy, come with the sequences (TrainSequence.vllm_logprobs).

The model trained is a `Policy`: DeepSpeed ZeRO-3 in production (learner/zero_models.py), a
plain torch model in the tests, where the micro-batching invariants are checked in float64.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from groupflow.config.algorithm import AlgorithmConfig
from groupflow.core.device import to_device
from groupflow.core.records import TrainSequence
from groupflow.learner.auto_threshold import RunningProbabilityThreshold
from groupflow.learner.credit import (
    CreditPlan,
    MiniBatchTokens,
    Reducer,
    length_scale,
    micro_batch_rows,
    plan_credit,
    plans_per_micro_batch,
)
from groupflow.learner.diagnostics import cancellation_residual
from groupflow.learner.figures import ProximalFigures, RankFigures, UpdateFigures
from groupflow.learner.micro_batch import (
    MicroBatchForward,
    forward_micro_batch,
    micro_batch_loss,
)
from groupflow.learner.moe_aux import MiniBatchRouting, MoeRouting
from groupflow.learner.sequence_parallel import SequenceParallel
from groupflow.learner.token_stats import TokenStats, loss_masks

MicroBatches = list[list[TrainSequence]]  # [micro-batch] -> sequences
MicroBatchStats = list[list[TokenStats]]  # [micro-batch] -> one TokenStats per sequence


class Policy(Protocol):
    """The model being trained, with the backward and the optimizer update of its wrapper (DeepSpeed in production)."""

    model: torch.nn.Module  # (input_ids, attention_mask) -> output with .logits
    device: torch.device

    def backward(self, loss: Tensor, last_micro_batch: bool) -> None:
        """Accumulate the gradient of `loss`; the ranks' gradients must add up, not average."""
        ...

    def step(self) -> float:
        """One optimizer update with the accumulated gradient; its global norm (NaN if unknown)."""
        ...


@dataclass
class StepSettings:
    algorithm: AlgorithmConfig
    temperature: float  # the sampling temperature: log-probs are taken at logits / T
    reducer: Reducer
    packed: bool = True  # several sequences to a row (learner.pack_sequences)
    # STAPO's running threshold with `stapo.tau_p: auto` (kept by the rank across steps)
    auto_tau_p: RunningProbabilityThreshold | None = None
    # This rank's sequence-parallel group (learner.sequence_parallel_size > 1), else None; the
    # reducer then spans the ranks of the same shard (learner/sequence_parallel.py)
    sequence_parallel: SequenceParallel | None = None
    # A mixture of experts' routers (learner/moe_aux.py), set by the rank; None: a dense model
    moe: MoeRouting | None = None

    @classmethod
    def of(
        cls,
        algorithm: AlgorithmConfig,
        temperature: float,
        reducer: Reducer,
        packed: bool,
        sequence_parallel: SequenceParallel | None = None,
    ):
        """The settings of a rank for the run; the running threshold starts empty."""
        auto = None
        if algorithm.stapo.tau_p == "auto":
            auto = RunningProbabilityThreshold(
                algorithm.stapo.target_share, algorithm.stapo.auto_decay
            )
        return cls(algorithm, temperature, reducer, packed, auto, sequence_parallel)


def no_grad_stats(
    model, micro_batches: MicroBatches, settings: StepSettings, device: torch.device
) -> MicroBatchStats:
    """Statistics of every micro-batch under `model` without a graph: old_logp, ref_logp, or
    the current policy's for a plan. Empty micro-batches still run (ZeRO-3's gathers)."""
    with torch.no_grad():
        return [
            forward_micro_batch(
                model,
                mb,
                settings.temperature,
                device,
                False,
                settings.packed,
                settings.sequence_parallel,
            ).stats
            for mb in micro_batches
        ]


def train_step(
    policy: Policy, reference, minibatches: list[MicroBatches], settings: StepSettings
) -> RankFigures:
    """Train this rank's share of one step; `reference` is the frozen KL reference or None."""
    # old_logp, the proximal policy of decoupled PPO (learner/off_policy.py), belongs to the
    # weights at the start of the step, for every mini-batch and both Lopti passes, so it is
    # taken now, before the first update moves the weights. The first mini-batch takes it
    # from its own forwards instead where it can (train_mini_batch): they run at those same
    # weights.
    own = plans_per_micro_batch(settings.algorithm)
    proximal = [
        None
        if m == 0 and (own or len(mini) == 1)
        else no_grad_stats(policy.model, mini, settings, policy.device)
        for m, mini in enumerate(minibatches)
    ]
    figures = RankFigures()
    for m, (mini, old) in enumerate(zip(minibatches, proximal, strict=True)):
        ref_logp = None
        if reference is not None:
            ref = no_grad_stats(reference, mini, settings, policy.device)
            ref_logp = [[s.logp for s in mb] for mb in ref]
        figures = figures.extend(
            train_mini_batch(policy, mini, old, ref_logp, settings, at_proximal_weights=m == 0)
        )
    return figures


def train_mini_batch(
    policy: Policy,
    micro_batches: MicroBatches,
    proximal: MicroBatchStats | None,
    ref_logp: list[list[Tensor]] | None,
    settings: StepSettings,
    at_proximal_weights: bool,
) -> RankFigures:
    """Plan the credit of one mini-batch and make one optimizer update per pass of the plan.

    proximal: the old policy's statistics per micro-batch, or None to take them from this
    mini-batch's own forwards: allowed only at the proximal weights, and for a single
    micro-batch unless each micro-batch is planned on its own (plans_per_micro_batch).
    ref_logp: the reference policy's log-probs per micro-batch and sequence (KL on) or None.
    """
    if plans_per_micro_batch(settings.algorithm):
        if proximal is None and not at_proximal_weights:
            raise ValueError(
                "proximal statistics come from the update's own forwards only "
                "at the proximal weights"
            )
        return plan_each_micro_batch(policy, micro_batches, proximal, ref_logp, settings)
    return plan_whole_mini_batch(
        policy, micro_batches, proximal, ref_logp, settings, at_proximal_weights
    )


def plan_each_micro_batch(
    policy: Policy,
    micro_batches: MicroBatches,
    proximal: MicroBatchStats | None,
    ref_logp: list[list[Tensor]] | None,
    settings: StepSettings,
) -> RankFigures:
    """One pass: each micro-batch's forward gives its own statistics, its rows of the plan
    (the global part of c_it comes from the response lengths), its loss and its backward,
    while no other micro-batch's graph is alive. The whole mini-batch's plan is made once
    more at the end, for its figures only."""
    algo = settings.algorithm
    lengths = [s.num_model_tokens for mb in micro_batches for s in mb]
    scale = length_scale(algo.aggregation, lengths, settings.reducer)
    refs = ref_logp if ref_logp is not None else [None] * len(micro_batches)
    olds, currents, grads = [], [], []
    update = UpdateFigures.zero_sums(policy.device)
    moe = MiniBatchRouting.start(settings.moe, micro_batches, settings.reducer, policy.device)
    for k, (mb, mb_ref) in enumerate(zip(micro_batches, refs, strict=True)):
        forward = _forward(policy, mb, settings)
        current = _detached(forward.stats)
        old = current if proximal is None else proximal[k]
        rows = micro_batch_rows(mini_batch_tokens(mb, old, current, policy.device), algo, scale)
        out = micro_batch_loss(forward, old, mb_ref, rows, 0, algo, algo.cancellation_diagnostic)
        loss = out.loss if moe is None else out.loss + moe.loss(forward.routed, counted=True)
        policy.backward(loss, last_micro_batch=k == len(micro_batches) - 1)
        update += out.figure_sums
        olds += old
        currents += current
        grads += out.token_grads
    grad_norms = [policy.step()]
    seqs = [s for mb in micro_batches for s in mb]
    plan = plan_credit(
        mini_batch_tokens(seqs, olds, currents, policy.device),
        algo,
        settings.reducer,
        settings.auto_tau_p,
    )
    return _figures(
        seqs,
        olds,
        UpdateFigures.of_sums(update),
        plan,
        grad_norms,
        grads if algo.cancellation_diagnostic else None,
        moe,
    )


def plan_whole_mini_batch(
    policy: Policy,
    micro_batches: MicroBatches,
    proximal: MicroBatchStats | None,
    ref_logp: list[list[Tensor]] | None,
    settings: StepSettings,
    at_proximal_weights: bool,
) -> RankFigures:
    """The plan needs the current policy's statistics of the whole mini-batch before the
    first backward (its quantiles, group weights or Lopti's split are global). A single
    micro-batch gets them from its first forward, whose graph then serves the first pass: no
    forward is spent on statistics alone. With several micro-batches that would keep every
    micro-batch's graph alive until the plan is made, k times the activations that
    micro_batch_tokens bounds, so they come from a no-grad forward instead, or are the
    proximal ones at the same weights."""
    algo = settings.algorithm
    single = len(micro_batches) == 1
    if proximal is None and not (single and at_proximal_weights):
        raise ValueError(
            "proximal statistics can only come from the update's own forward for a single "
            "micro-batch at the proximal weights"
        )
    first: MicroBatchForward | None = None
    if single:
        first = _forward(policy, micro_batches[0], settings)
        current = [_detached(first.stats)]
    elif at_proximal_weights:
        current = proximal
    else:
        current = no_grad_stats(policy.model, micro_batches, settings, policy.device)
    old = current if proximal is None else proximal

    seqs = [s for mb in micro_batches for s in mb]
    flat_old = [s for mb in old for s in mb]
    tokens = mini_batch_tokens(seqs, flat_old, [s for mb in current for s in mb], policy.device)
    plan = plan_credit(tokens, algo, settings.reducer, settings.auto_tau_p)
    # Each micro-batch carries its own rows of the plan, its proximal and reference rows and
    # its gradient accumulators: nothing is looked up by a running offset.
    rows = plan.split([len(mb) for mb in micro_batches])
    refs = ref_logp if ref_logp is not None else [None] * len(micro_batches)
    diagnostic = algo.cancellation_diagnostic
    grads = [
        [torch.zeros(s.num_response_tokens, dtype=torch.float64, device=policy.device) for s in mb]
        if diagnostic
        else []
        for mb in micro_batches
    ]
    update, grad_norms = UpdateFigures.zero_sums(policy.device), []
    moe = MiniBatchRouting.start(settings.moe, micro_batches, settings.reducer, policy.device)
    for pass_index in range(len(plan.passes)):
        for k, parts in enumerate(zip(micro_batches, rows, old, refs, grads, strict=True)):
            mb, mb_rows, mb_old, mb_ref, mb_grads = parts
            forward = first if first is not None else _forward(policy, mb, settings)
            first = None  # later passes run after an update: they need a fresh forward
            out = micro_batch_loss(forward, mb_old, mb_ref, mb_rows, pass_index, algo, diagnostic)
            loss = out.loss
            if moe is not None:  # each micro-batch's routing counts once, in the first pass
                loss = loss + moe.loss(forward.routed, counted=pass_index == 0)
            policy.backward(loss, last_micro_batch=k == len(micro_batches) - 1)
            update += out.figure_sums
            for acc, g in zip(mb_grads, out.token_grads, strict=True):
                acc += g
        grad_norms.append(policy.step())
    flat_grads = [g for mb in grads for g in mb] if diagnostic else None
    return _figures(
        seqs, flat_old, UpdateFigures.of_sums(update), plan, grad_norms, flat_grads, moe
    )


def _figures(
    seqs: list[TrainSequence],
    old: list[TokenStats],
    update: UpdateFigures,
    plan: CreditPlan,
    grad_norms: list[float],
    token_grads: list[Tensor] | None,
    moe: MiniBatchRouting | None,
) -> RankFigures:
    """A mini-batch's figures; the cancellation residual from dLoss/dlogp per sequence
    (summed over the passes) when the diagnostic collected them; a mixture of experts'
    routing."""
    figures = RankFigures(
        proximal=ProximalFigures.of(seqs, old),
        update=update,
        credit=[plan.stats],
        grad_norms=grad_norms,
        off_policy=plan.off_policy,
    )
    if moe is not None:
        figures.moe = moe.figures()
    if token_grads is not None:
        # One copy to the host for all sequences (they lie on the device)
        sizes = [g.numel() for g in token_grads]
        host = torch.cat(token_grads).cpu() if token_grads else torch.zeros(0)
        groups = _groups(seqs, list(host.split(sizes)))
        figures.residual = cancellation_residual(groups)
        figures.residual_whole_group = cancellation_residual(groups, whole_group=True)
    return figures


def _forward(
    policy: Policy, seqs: list[TrainSequence], settings: StepSettings
) -> MicroBatchForward:
    entropy_grad = settings.algorithm.entropy_coef != 0  # an entropy bonus backpropagates
    return forward_micro_batch(
        policy.model,
        seqs,
        settings.temperature,
        policy.device,
        entropy_grad,
        settings.packed,
        settings.sequence_parallel,
        settings.moe,
    )


def _detached(stats: list[TokenStats]) -> list[TokenStats]:
    return [TokenStats(s.logp.detach(), s.entropy.detach(), s.sum_p2.detach()) for s in stats]


def _groups(seqs: list[TrainSequence], grads: list[Tensor]) -> list[list[tuple[list[int], Tensor]]]:
    """Per group, (response token ids, dLoss/dlogp summed over the passes) of each response."""
    by_group: dict[int, list[tuple[list[int], Tensor]]] = defaultdict(list)
    for seq, g in zip(seqs, grads, strict=True):
        by_group[seq.group_id].append((seq.input_ids[seq.prompt_len :], g))
    return list(by_group.values())


def _pad(rows: list[Tensor], device: torch.device) -> Tensor:
    if not rows:  # a rank may hold no sequence of a mini-batch; it still joins the plan
        return torch.zeros(0, 0, device=device)
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True).to(device)


def mini_batch_tokens(
    seqs: list[TrainSequence],
    old: list[TokenStats],
    current: list[TokenStats],
    device: torch.device,
) -> MiniBatchTokens:
    """The credit planner's view of a mini-batch: one row per sequence, padded; observation
    tokens (TrainSequence.loss_mask) masked as padding is.

    A sequence without vLLM's log-probs takes its behaviour row from `old` (weight 1); vLLM's
    log-probs, one per model token, go to the model tokens' places."""
    masks = loss_masks(seqs, [o.logp for o in old])
    behaviour = [
        _at_model_tokens(s.vllm_logprobs, mask, o.logp) if s.vllm_logprobs else o.logp
        for s, o, mask in zip(seqs, old, masks, strict=True)
    ]
    return MiniBatchTokens(
        mask=_pad(masks, device),
        old_logp=_pad([s.logp for s in old], device),
        cur_logp=_pad([s.logp for s in current], device),
        old_entropy=_pad([s.entropy for s in old], device),
        cur_entropy=_pad([s.entropy for s in current], device),
        cur_sum_p2=_pad([s.sum_p2 for s in current], device),
        advantages=to_device(
            torch.tensor([s.advantage for s in seqs], dtype=torch.float64), device
        ),
        group_ids=to_device(torch.tensor([s.group_id for s in seqs], dtype=torch.long), device),
        behaviour_logp=_pad(behaviour, device),
        behaviour_known=to_device(
            torch.tensor([bool(s.vllm_logprobs) for s in seqs], dtype=torch.bool), device
        ),
    )


def _at_model_tokens(logprobs: list[float], mask: Tensor, stand_in: Tensor) -> Tensor:
    """`logprobs` (one per model token) in the places of the model tokens of a row like
    `stand_in`, which keeps the observations' places (masked: never read)."""
    row = stand_in.detach().clone()
    row[mask > 0] = to_device(torch.tensor(logprobs, dtype=row.dtype), row.device)
    return row
