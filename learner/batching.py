"""How a step's sequences are cut into mini-batches, ranks and micro-batches.

Rules that the credit math relies on:
- a group never spans ranks (group-level transforms stay rank-local) and never spans
  mini-batches (its advantages are only meaningful together);
- ranks get about the same number of tokens (they wait for each other at every layer);
- every rank runs the same number of micro-batches in a mini-batch, because ZeRO-3's
  forward gathers parameters collectively; a rank with less work gets empty micro-batches.
"""

from __future__ import annotations

from collections import defaultdict

StepPlan = list[list[list[list[int]]]]  # [rank][mini-batch][micro-batch] -> sequence indices


def plan_step(
    lengths: list[int],
    group_ids: list[int],
    num_ranks: int,
    mini_batches: int,
    micro_batch_tokens: int,
) -> StepPlan:
    groups: dict[int, list[int]] = defaultdict(list)
    for index, group in enumerate(group_ids):
        groups[group].append(index)
    ordered = list(groups.values())
    if mini_batches > len(ordered):
        raise ValueError(f"cannot cut {len(ordered)} groups into {mini_batches} mini-batches")

    plan: StepPlan = [[] for _ in range(num_ranks)]
    for m in range(mini_batches):
        chunk = ordered[m * len(ordered) // mini_batches : (m + 1) * len(ordered) // mini_batches]
        per_rank = _balance(chunk, lengths, num_ranks)
        micro = [_pack(indices, lengths, micro_batch_tokens) for indices in per_rank]
        depth = max(len(mb) for mb in micro)
        for rank in range(num_ranks):
            plan[rank].append(micro[rank] + [[] for _ in range(depth - len(micro[rank]))])
    return plan


def _balance(groups: list[list[int]], lengths: list[int], num_ranks: int) -> list[list[int]]:
    """Largest group first onto the least-loaded rank."""
    load = [0] * num_ranks
    out: list[list[int]] = [[] for _ in range(num_ranks)]
    for group in sorted(groups, key=lambda g: -sum(lengths[i] for i in g)):
        rank = min(range(num_ranks), key=load.__getitem__)
        out[rank].extend(group)
        load[rank] += sum(lengths[i] for i in group)
    return out


def _pack(indices: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive sequences up to `budget` tokens each (a longer sequence goes alone)."""
    batches: list[list[int]] = []
    used = budget
    for i in indices:
        if used + lengths[i] > budget:
            batches.append([])
            used = 0
        batches[-1].append(i)
        used += lengths[i]
    return batches
