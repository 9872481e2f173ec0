"""Scored groups -> the learner's training sequences, each with its group-relative advantage.

Two steps, so that what the model was told (the advantages, also written to the sample logs)
is computed once: `group_advantages` shapes the rewards and normalises them within each
group; `train_sequences` turns the responses into what the learner trains on.
"""

from __future__ import annotations

import torch

from groupflow.config import AlgorithmConfig, Config
from groupflow.core.records import ScoredGroup, TrainSequence
from groupflow.learner.advantages import compute_advantages, overlong_penalty


def group_advantages(scored: list[ScoredGroup], cfg: Config) -> list[list[float]]:
    """`advantages[g][j]`: response j of group g's advantage, from the verifier's reward plus
    DAPO's overlong penalty when `reward.overlong_penalty` is set."""
    rewards, groups, counts, limits = [], [], [], []
    multi_turn = cfg.multi_turn
    for gid, sg in enumerate(scored):
        limit = sg.group.prompt.max_tokens or cfg.rollout.sampling.max_tokens
        if multi_turn:  # a trajectory's budget is its total, observations included
            limit = cfg.agent.max_total_tokens or cfg.rollout.max_model_len - len(
                sg.group.prompt_ids
            )
        for reward, resp in zip(sg.rewards, sg.group.responses, strict=True):
            rewards.append(reward)
            groups.append(gid)
            counts.append(len(resp.token_ids))
            limits.append(limit)
    rewards = torch.tensor(rewards, dtype=torch.float64)
    lengths = torch.tensor(counts, dtype=torch.float64)
    penalty = cfg.reward.overlong_penalty
    if penalty is not None:
        limit = torch.tensor(limits, dtype=torch.float64)  # each response's task's max_tokens
        rewards = rewards + overlong_penalty(
            lengths, limit, penalty.buffer_tokens, penalty.max_penalty
        )
    algo = cfg.algorithm
    flat = compute_advantages(
        rewards, torch.tensor(groups), algo.advantage, algo.std, token_counts=lengths
    ).tolist()
    out, start = [], 0
    for sg in scored:
        out.append(flat[start : start + len(sg.group.responses)])
        start += len(sg.group.responses)
    return out


def train_sequences(
    scored: list[ScoredGroup], advantages: list[list[float]], algo: AlgorithmConfig
) -> list[TrainSequence]:
    """One sequence per response, and one per earlier sequence a harness trajectory split
    into (`Response.earlier`, rollout/harness_record.py), each with the response's advantage
    and on its own prompt ids; `group_id` is the group's index within the step. With
    `algorithm.mask_truncated`, responses cut at the length limit are left out (they took part
    in their group's baseline, but nothing is trained on them)."""
    seqs = []
    for gid, (sg, group_adv) in enumerate(zip(scored, advantages, strict=True)):
        for resp, advantage in zip(sg.group.responses, group_adv, strict=True):
            for part in (*resp.earlier, resp):
                if algo.mask_truncated and part.finish_reason == "length":
                    continue
                prompt_ids = sg.group.prompt_ids if part.prompt_ids is None else part.prompt_ids
                seqs.append(
                    TrainSequence(
                        input_ids=prompt_ids + part.token_ids,
                        prompt_len=len(prompt_ids),
                        advantage=advantage,
                        group_id=gid,
                        policy_version=sg.group.policy_version,
                        vllm_logprobs=part.logprobs,
                        loss_mask=part.loss_mask,
                        routed_experts=part.routed_experts,
                    )
                )
    return seqs
