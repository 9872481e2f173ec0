"""Scored groups -> advantages and training sequences: length shaping and truncation masking."""

import random

import pytest
import torch

from groupflow.core.records import Prompt, Response, SampledGroup, ScoredGroup, Verdict
from groupflow.learner.advantages import compute_advantages
from groupflow.loop.sequences import group_advantages, train_sequences
from groupflow.run.job_config import build_config

MAX_TOKENS = 12


def _scored(rng: random.Random, n_groups: int, size: int) -> list[ScoredGroup]:
    out = []
    for g in range(n_groups):
        responses = []
        for _ in range(size):
            n = rng.randint(1, MAX_TOKENS)
            finish = "length" if n == MAX_TOKENS and rng.random() < 0.8 else "stop"
            responses.append(Response(list(range(n)), "", [-0.1] * n, finish))
        verdicts = [Verdict(float(rng.random() < 0.5), "") for _ in range(size)]
        group = SampledGroup(Prompt(f"p{g}", "", None), [7] * rng.randint(1, 4), responses, 0)
        out.append(ScoredGroup(group, verdicts))
    return out


def _cfg(**sections):
    return build_config({"rollout": {"sampling": {"max_tokens": MAX_TOKENS}}, **sections})


def test_advantages_are_the_estimators_over_the_whole_step():
    rng = random.Random()
    scored = _scored(rng, rng.randint(1, 6), rng.randint(2, 8))
    cfg = _cfg()
    got = group_advantages(scored, cfg)
    rewards = torch.tensor([r for sg in scored for r in sg.rewards], dtype=torch.float64)
    ids = torch.tensor([g for g, sg in enumerate(scored) for _ in sg.rewards])
    want = compute_advantages(rewards, ids, cfg.algorithm.advantage, cfg.algorithm.std)
    assert sum(got, []) == pytest.approx(want.tolist(), abs=1e-12)
    assert [len(a) for a in got] == [len(sg.rewards) for sg in scored]


def test_overlong_penalty_lowers_only_long_responses_reward():
    rng = random.Random()
    size = rng.randint(2, 8)
    scored = _scored(rng, 1, size)
    cfg = _cfg(reward={"overlong_penalty": {"buffer_tokens": 4, "max_penalty": 0.5}})
    got = group_advantages(scored, cfg)[0]
    shaped = [
        r - 0.5 * max(0, len(resp.token_ids) - (MAX_TOKENS - 4)) / 4
        for r, resp in zip(scored[0].rewards, scored[0].group.responses, strict=True)
    ]
    want = compute_advantages(
        torch.tensor(shaped, dtype=torch.float64),
        torch.zeros(size, dtype=torch.long),
        cfg.algorithm.advantage,
        cfg.algorithm.std,
    )
    assert got == pytest.approx(want.tolist(), abs=1e-12)


@pytest.mark.parametrize("mask", [False, True])
def test_truncated_responses_are_left_out_only_when_masked(mask):
    rng = random.Random()
    scored = _scored(rng, rng.randint(2, 6), rng.randint(2, 8))
    cfg = _cfg(algorithm={"mask_truncated": mask})
    advantages = group_advantages(scored, cfg)
    seqs = train_sequences(scored, advantages, cfg.algorithm)
    kept = [
        (g, resp, adv)
        for g, (sg, advs) in enumerate(zip(scored, advantages, strict=True))
        for resp, adv in zip(sg.group.responses, advs, strict=True)
        if not (mask and resp.finish_reason == "length")
    ]
    assert len(seqs) == len(kept)
    for seq, (g, resp, adv) in zip(seqs, kept, strict=True):
        assert seq.group_id == g and seq.advantage == adv
        assert seq.input_ids[seq.prompt_len :] == resp.token_ids


def test_overlong_penalty_counts_from_each_tasks_own_limit():
    rng = random.Random()
    scored = _scored(rng, 2, 4)
    scored[0].group.prompt.max_tokens = 6  # one task's shorter limit
    cfg = _cfg(reward={"overlong_penalty": {"buffer_tokens": 4, "max_penalty": 1.0}})
    got = group_advantages(scored, cfg)
    shaped, ids = [], []
    for g, sg in enumerate(scored):
        limit = sg.group.prompt.max_tokens or MAX_TOKENS
        for r, resp in zip(sg.rewards, sg.group.responses, strict=True):
            shaped.append(r - min(1.0, max(0, len(resp.token_ids) - (limit - 4)) / 4))
            ids.append(g)
    want = compute_advantages(
        torch.tensor(shaped, dtype=torch.float64),
        torch.tensor(ids),
        cfg.algorithm.advantage,
        cfg.algorithm.std,
    )
    assert sum(got, []) == pytest.approx(want.tolist(), abs=1e-12)
