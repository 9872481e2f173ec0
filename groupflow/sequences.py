"""Scored groups -> the learner's training sequences, each with its group-relative advantage."""

from __future__ import annotations

import torch

from groupflow.config import AlgorithmConfig
from groupflow.learner.advantages import compute_advantages
from groupflow.records import ScoredGroup, TrainSequence


def train_sequences(scored: list[ScoredGroup], algo: AlgorithmConfig) -> list[TrainSequence]:
    """One sequence per response; `group_id` is the group's index within the step."""
    rewards, groups, counts = [], [], []
    for gid, sg in enumerate(scored):
        for reward, resp in zip(sg.rewards, sg.group.responses, strict=True):
            rewards.append(reward)
            groups.append(gid)
            counts.append(len(resp.token_ids))
    advantages = compute_advantages(
        torch.tensor(rewards, dtype=torch.float64),
        torch.tensor(groups),
        algo.advantage,
        algo.std,
        token_counts=torch.tensor(counts, dtype=torch.float64),
    ).tolist()
    seqs = []
    for gid, sg in enumerate(scored):
        for resp in sg.group.responses:
            seqs.append(
                TrainSequence(
                    input_ids=sg.group.prompt_ids + resp.token_ids,
                    prompt_len=len(sg.group.prompt_ids),
                    advantage=advantages[len(seqs)],
                    group_id=gid,
                    policy_version=sg.group.policy_version,
                    vllm_logprobs=resp.logprobs,
                )
            )
    return seqs
