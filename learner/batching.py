"""How a step's sequences are laid out into mini-batches, ranks and micro-batches.

Rules that the credit math relies on:
- a group never spans ranks (group-level transforms stay rank-local) and never spans
  mini-batches (its advantages are only meaningful together);
- ranks get about the same number of tokens (they wait for each other at every layer);
- every rank runs the same number of micro-batches in a mini-batch, because ZeRO-3's
  forward gathers parameters collectively; a rank with less work gets empty micro-batches.

Within a rank's share of a mini-batch, sequences of similar length share a micro-batch, so
little of a padded micro-batch is padding; `micro_batch_tokens` bounds the positions the
forward computes (rows x longest row), which is what activation memory grows with: a row per
sequence, or, `packed`, the rows that `pack_rows` fills, several sequences to a row
(learner/micro_batch.py packs so), so that a packed micro-batch takes about
`micro_batch_tokens` real tokens.

With sequence parallelism (learner.sequence_parallel_size P) the layout is over the P-rank
groups, whose ranks share each micro-batch, each computing ceil(width / P) positions of every
row (learner/sequence_parallel.py): the budget per rank counts a row at that share, so a
sequence P times longer than the budget alone still fits a micro-batch of its own.
"""

from __future__ import annotations

from collections import defaultdict

StepLayout = list[list[list[list[int]]]]  # [rank][mini-batch][micro-batch] -> sequence indices


def layout_step(
    lengths: list[int],
    group_ids: list[int],
    num_ranks: int,
    mini_batches: int,
    micro_batch_tokens: int,
    packed: bool = False,
    sequence_parallel: int = 1,
) -> StepLayout:
    """[rank][mini-batch][micro-batch] -> sequence indices; the ranks are data-parallel ranks
    (sequence-parallel groups: every rank of a group takes its group's layout)."""
    if len(lengths) != len(group_ids):
        raise ValueError(f"layout_step: {len(lengths)} lengths but {len(group_ids)} group ids")
    groups: dict[int, list[int]] = defaultdict(list)
    for index, group in enumerate(group_ids):
        groups[group].append(index)
    ordered = list(groups.values())
    if mini_batches > len(ordered):
        raise ValueError(f"cannot cut {len(ordered)} groups into {mini_batches} mini-batches")

    layout: StepLayout = [[] for _ in range(num_ranks)]
    for m in range(mini_batches):
        chunk = ordered[m * len(ordered) // mini_batches : (m + 1) * len(ordered) // mini_batches]
        per_rank = _balance(chunk, lengths, num_ranks)
        micro = [
            _pack(indices, lengths, micro_batch_tokens, packed, sequence_parallel)
            for indices in per_rank
        ]
        depth = max(len(mb) for mb in micro)
        for rank in range(num_ranks):
            layout[rank].append(micro[rank] + [[] for _ in range(depth - len(micro[rank]))])
    return layout


def padding_share(layout: StepLayout, lengths: list[int]) -> float:
    """Share of the micro-batches' padded positions (rows x longest row) that is padding."""
    real = padded = 0
    for rank in layout:
        for mini in rank:
            for micro in mini:
                if micro:
                    real += sum(lengths[i] for i in micro)
                    padded += len(micro) * max(lengths[i] for i in micro)
    return 1 - real / padded if padded else 0.0


def _balance(groups: list[list[int]], lengths: list[int], num_ranks: int) -> list[list[int]]:
    """Largest group first onto the least-loaded rank."""
    load = [0] * num_ranks
    out: list[list[int]] = [[] for _ in range(num_ranks)]
    for group in sorted(groups, key=lambda g: -sum(lengths[i] for i in g)):
        rank = min(range(num_ranks), key=load.__getitem__)
        out[rank].extend(group)
        load[rank] += sum(lengths[i] for i in group)
    return out


def first_fit_row(used: list[int], length: int, width: int) -> int:
    """The first row, of rows of `width` positions with `used` filled, that has room for
    `length` more; len(used) if none has (a new row)."""
    return next((r for r, n in enumerate(used) if n + length <= width), len(used))


def pack_rows(lengths: list[int]) -> tuple[list[int], list[int], int]:
    """(row, start) of each sequence and the number of rows: longest first, each into the
    first row with room, every row as wide as the longest sequence, so that a row's attention
    costs no more than a padded batch's (learner/micro_batch.py packs micro-batches so)."""
    width = max(lengths)
    rows, starts, used = [0] * len(lengths), [0] * len(lengths), []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = first_fit_row(used, lengths[i], width)
        if row == len(used):
            used.append(0)
        rows[i], starts[i] = row, used[row]
        used[row] += lengths[i]
    return rows, starts, len(used)


def _pack(
    indices: list[int], lengths: list[int], budget: int, packed: bool, shards: int = 1
) -> list[list[int]]:
    """Longest sequence first; a micro-batch takes the next sequence while its rows times its
    longest row's share of a rank (ceil(width / shards)) stay within `budget` (a longer
    sequence goes alone). Rows: one per sequence,
    or, `packed`, each sequence in the first row with room, as `pack_rows` places them (it
    sees them in this same order, and uses the same `first_fit_row`). On sorted lengths this greedy cut gives the fewest
    micro-batches, and neighbours differ little in length."""
    batches: list[list[int]] = []
    used: list[int] = []  # filled positions of each row of the open micro-batch
    width = 0
    for i in sorted(indices, key=lambda i: -lengths[i]):
        n = lengths[i]
        row = first_fit_row(used, n, width) if packed else len(used)
        if batches and max(len(used), row + 1) * -(-width // shards) <= budget:
            batches[-1].append(i)
            if row == len(used):
                used.append(0)
            used[row] += n
        else:
            batches.append([i])
            used, width = [n], n
    return batches
