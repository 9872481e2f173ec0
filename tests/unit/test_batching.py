import random

import pytest

from groupflow.learner.batching import plan_step


def _random_step(rng):
    groups = rng.randint(2, 12)
    group_size = rng.randint(1, 6)
    lengths = [rng.randint(1, 50) for _ in range(groups * group_size)]
    group_ids = [i // group_size for i in range(len(lengths))]
    return lengths, group_ids, groups


@pytest.mark.parametrize("trial", range(20))
def test_plan_covers_every_sequence_once_and_keeps_groups_whole(trial):
    rng = random.Random()
    lengths, group_ids, groups = _random_step(rng)
    ranks, minis, budget = rng.randint(1, 3), rng.randint(1, groups), rng.randint(10, 120)
    plan = plan_step(lengths, group_ids, ranks, minis, budget)
    seen = [i for rank in plan for mini in rank for micro in mini for i in micro]
    assert sorted(seen) == list(range(len(lengths)))
    for m in range(minis):
        # same micro-batch count on every rank (ZeRO-3 gathers are collective)
        assert len({len(plan[r][m]) for r in range(ranks)}) == 1
        owners = {}
        for r in range(ranks):
            for micro in plan[r][m]:
                assert len(micro) <= 1 or sum(lengths[i] for i in micro) <= budget
                for i in micro:
                    owners.setdefault(group_ids[i], set()).add((r, m))
        assert all(len(o) == 1 for o in owners.values())
    mini_of = {
        group_ids[i]: m for r in plan for m, mini in enumerate(r) for micro in mini for i in micro
    }
    assert len(mini_of) == groups


def test_too_many_mini_batches_is_refused():
    with pytest.raises(ValueError, match="mini-batches"):
        plan_step([3, 3], [0, 0], 1, 2, 10)
