import random

import pytest

from groupflow.learner.batching import layout_step, pack_rows, padding_share


def _random_step(rng):
    groups = rng.randint(2, 12)
    group_size = rng.randint(1, 6)
    lengths = [rng.randint(1, 50) for _ in range(groups * group_size)]
    group_ids = [i // group_size for i in range(len(lengths))]
    rng.shuffle(group_ids)  # a group's members need not be adjacent
    return lengths, group_ids, groups


def probe_mix(rng, groups=32, group_size=8, prompt=128, max_response=1024):
    """The GPU probes' step: 32 groups x 8 responses, 128 prompt + 128..1024 response tokens."""
    lengths = [
        prompt + rng.randint(max_response // 8, max_response) for _ in range(groups * group_size)
    ]
    return lengths, [i // group_size for i in range(len(lengths))]


@pytest.mark.parametrize("trial", range(30))
def test_layout_keeps_the_rules(trial):
    rng = random.Random()
    lengths, group_ids, groups = _random_step(rng)
    ranks, minis, budget = rng.randint(1, 3), rng.randint(1, groups), rng.randint(10, 120)
    layout = layout_step(lengths, group_ids, ranks, minis, budget)
    seen = [i for rank in layout for mini in rank for micro in mini for i in micro]
    assert sorted(seen) == list(range(len(lengths)))
    for m in range(minis):
        # same micro-batch count on every rank (ZeRO-3 gathers are collective)
        assert len({len(layout[r][m]) for r in range(ranks)}) == 1
        owners = {}
        loads = []
        for r in range(ranks):
            for micro in layout[r][m]:
                for i in micro:
                    owners.setdefault(group_ids[i], set()).add((r, m))
            loads.append(sum(lengths[i] for micro in layout[r][m] for i in micro))
        assert all(len(o) == 1 for o in owners.values())
        # ranks balanced: the gap is at most one group's tokens
        group_tokens = {}
        for i, g in enumerate(group_ids):
            group_tokens[g] = group_tokens.get(g, 0) + lengths[i]
        assert max(loads) - min(loads) <= max(group_tokens.values())
    mini_of = {
        group_ids[i]: m for r in layout for m, mini in enumerate(r) for micro in mini for i in micro
    }
    assert len(mini_of) == groups


@pytest.mark.parametrize("trial", range(30))
def test_micro_batches_fit_the_budget_in_padded_positions_and_are_full(trial):
    rng = random.Random()
    lengths, group_ids, groups = _random_step(rng)
    ranks, minis, budget = rng.randint(1, 3), rng.randint(1, groups), rng.randint(10, 120)
    layout = layout_step(lengths, group_ids, ranks, minis, budget)
    for rank in layout:
        for mini in rank:
            filled = [micro for micro in mini if micro]
            for k, micro in enumerate(filled):
                width = max(lengths[i] for i in micro)
                # padded positions within budget (a sequence longer than it goes alone)
                assert len(micro) * width <= budget or len(micro) == 1
                if k + 1 < len(filled):
                    # closed only because the next (no longer) sequence did not fit
                    assert (len(micro) + 1) * width > budget
                    assert min(lengths[i] for i in micro) >= max(lengths[i] for i in filled[k + 1])


@pytest.mark.parametrize("trial", range(30))
def test_packed_micro_batches_fit_the_budget_in_packed_rows_and_are_full(trial):
    rng = random.Random()
    lengths, group_ids, groups = _random_step(rng)
    ranks, minis, budget = rng.randint(1, 3), rng.randint(1, groups), rng.randint(10, 120)
    layout = layout_step(lengths, group_ids, ranks, minis, budget, packed=True)
    padded = layout_step(lengths, group_ids, ranks, minis, budget)
    for rank, padded_rank in zip(layout, padded, strict=True):
        for mini, padded_mini in zip(rank, padded_rank, strict=True):
            filled = [[lengths[i] for i in micro] for micro in mini if micro]
            assert len(filled) <= len([m for m in padded_mini if m]), "never more than padded"
            for k, micro in enumerate(filled):
                # the rows the forward packs (in the order the rank gets them) within budget
                assert pack_rows(micro)[2] * max(micro) <= budget or len(micro) == 1
                if k + 1 < len(filled):
                    # closed only because the next (no longer) sequence did not fit
                    assert pack_rows([*micro, filled[k + 1][0]])[2] * max(micro) > budget
                    assert min(micro) >= max(filled[k + 1])


@pytest.mark.parametrize("budget", [16384, 4096])
@pytest.mark.parametrize("trial", range(5))
def test_padding_is_under_a_tenth_on_the_probe_mix(budget, trial):
    lengths, group_ids = probe_mix(random.Random())
    assert padding_share(layout_step(lengths, group_ids, 1, 1, budget), lengths) < 0.10


def test_padding_share_counts_rows_times_the_longest_row():
    assert padding_share([[[[0, 1], [2]], [[]]]], [4, 2, 5]) == pytest.approx(1 - 11 / 13)


def test_too_many_mini_batches_is_refused():
    with pytest.raises(ValueError, match="mini-batches"):
        layout_step([3, 3], [0, 0], 1, 2, 10)


def test_mismatched_inputs_are_named():
    with pytest.raises(ValueError, match="2 lengths but 3 group ids"):
        layout_step([3, 3], [0, 0, 1], 1, 1, 10)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("shards", [2, 4])
@pytest.mark.parametrize("trial", range(10))
def test_a_sharded_row_counts_at_its_share_of_a_rank(trial, shards, packed):
    """learner.sequence_parallel_size: each rank of a group computes ceil(width / P) positions
    of every row, so the per-rank budget holds P times the tokens, and no more."""
    rng = random.Random()
    lengths, group_ids, groups = _random_step(rng)
    minis, budget = rng.randint(1, groups), rng.randint(10, 120)
    layout = layout_step(lengths, group_ids, 1, minis, budget, packed, sequence_parallel=shards)
    for mini in layout[0]:
        filled = [[lengths[i] for i in micro] for micro in mini if micro]
        for k, micro in enumerate(filled):
            rows = pack_rows(micro)[2] if packed else len(micro)
            share = -(-max(micro) // shards)
            assert rows * share <= budget or len(micro) == 1
            if k + 1 < len(filled):  # closed only because the next sequence did not fit
                more = [*micro, filled[k + 1][0]]
                assert (pack_rows(more)[2] if packed else len(more)) * share > budget


def test_a_sequence_longer_than_the_budget_shares_a_micro_batch_once_sharded():
    lengths, group_ids = [8, 8, 8, 8], [0, 0, 1, 1]
    assert len(layout_step(lengths, group_ids, 1, 1, 8)[0][0]) == 4
    assert len(layout_step(lengths, group_ids, 1, 1, 8, sequence_parallel=2)[0][0]) == 2
    assert len(layout_step(lengths, group_ids, 1, 1, 8, sequence_parallel=4)[0][0]) == 1
