"""A rank's figures (learner/figures.py): built from tokens, merged over ranks, turned into the
step record's learner keys."""

from __future__ import annotations

import math
import pickle
from dataclasses import replace

import pytest
import torch

from groupflow.core.records import TrainSequence
from groupflow.learner.credit import CreditStats
from groupflow.learner.diagnostics import CancellationResidual
from groupflow.learner.figures import (
    ProximalFigures,
    RankFigures,
    UpdateFigures,
    learner_record,
)
from groupflow.learner.off_policy import OffPolicyFigures
from groupflow.learner.token_stats import TokenStats

F64 = torch.float64

# metrics.jsonl's learner keys: the metric catalogue, the dashboard and users rely on them.
LEARNER_KEYS = {
    "actor_memory_bytes",
    "actor_memory_limit_bytes",
    "entropy_mean",
    "entropy_pos",
    "entropy_neg",
    "clip_frac_low",
    "clip_frac_high",
    "clip_frac",
    "approx_kl",
    "kl_ref",
    "grad_norm",
    "optimizer_updates",
    "logp_mismatch_mean",
    "logp_mismatch_max",
    "is_weight_mean",
    "is_weight_max",
    "is_truncated_frac",
    "is_masked_frac",
    "kl_behaviour_proximal",
    "cancellation_residual",
    "cancellation_residual_whole_group",
    "valid_tokens",
    "trained_frac",
    "spurious_frac",
    "stapo_tau_p",
    "stapo_silenced_frac",
    "lowprob_frac",
    "lowprob_grad_share",
    "optimizer_passes",
}


def random_sequences(gen: torch.Generator, count: int = 7):
    seqs, stats = [], []
    for i in range(count):
        prompt = int(torch.randint(1, 4, (), generator=gen))
        n = int(torch.randint(1, 6, (), generator=gen))
        logp = -3 * torch.rand(n, generator=gen, dtype=F64)
        vllm = (
            [] if i % 3 == 0 else (logp + 0.01 * torch.randn(n, generator=gen, dtype=F64)).tolist()
        )
        seqs.append(
            TrainSequence(
                input_ids=list(range(prompt + n)),
                prompt_len=prompt,
                advantage=[1.0, -0.5, 0.0][i % 3] * (i + 1),
                group_id=i // 2,
                policy_version=0,
                vllm_logprobs=vllm,
            )
        )
        entropy = 2 * torch.rand(n, generator=gen, dtype=F64)
        stats.append(TokenStats(logp, entropy, torch.rand(n, generator=gen, dtype=F64)))
    return seqs, stats


def test_proximal_figures_match_a_loop(gen):
    seqs, stats = random_sequences(gen)
    got = ProximalFigures.of(seqs, stats)
    want = ProximalFigures()
    worst = 0.0
    for seq, s in zip(seqs, stats, strict=True):
        for t in range(seq.num_response_tokens):
            h = s.entropy[t].item()
            want.tokens += 1
            want.entropy += h
            if seq.advantage > 0:
                want.tokens_pos += 1
                want.entropy_pos += h
            if seq.advantage < 0:
                want.tokens_neg += 1
                want.entropy_neg += h
            if seq.vllm_logprobs:
                diff = abs(s.logp[t].item() - seq.vllm_logprobs[t])
                want.logp_mismatch += diff
                worst = max(worst, diff)
    want.logp_mismatch_max = worst
    assert got.tokens == want.tokens and got.tokens_pos == want.tokens_pos > 0
    assert got.tokens_neg == want.tokens_neg > 0
    for name in ("entropy", "entropy_pos", "entropy_neg", "logp_mismatch", "logp_mismatch_max"):
        assert getattr(got, name) == pytest.approx(getattr(want, name), rel=1e-12), name
    assert ProximalFigures.of([], []) == ProximalFigures()


def test_vllm_logprobs_of_the_wrong_length_are_refused(gen):
    seqs, _ = random_sequences(gen, count=2)
    seq = seqs[0] if seqs[0].vllm_logprobs else seqs[1]
    with pytest.raises(ValueError, match=f"group {seq.group_id}: .* vLLM log-probs"):
        replace(seq, vllm_logprobs=seq.vllm_logprobs + [0.0])


def credit(valid: float, passes: float) -> CreditStats:
    return CreditStats(valid, valid / 4, 0.9, 0.1, 0.002, 0.05, 0.3, 0.2, passes)


def rank_figures(seed: int, credits: list[CreditStats], grad_norms: list[float]) -> RankFigures:
    gen = torch.Generator().manual_seed(seed)
    seqs, stats = random_sequences(gen)
    return RankFigures(
        proximal=ProximalFigures.of(seqs, stats),
        update=UpdateFigures(
            tokens=40 + seed, clipped_low=3, clipped_high=seed, approx_kl=0.2, kl_ref=0.1
        ),
        residual=CancellationResidual(1.5 + seed, 4.0),
        residual_whole_group=CancellationResidual(0.0, 2.0 * seed),
        off_policy=OffPolicyFigures(
            tokens=20 + seed,
            weight=21.0 + seed,
            weight_max=1.5 + seed,
            truncated=seed,
            masked=1,
            kl=0.01 * seed,
        ),
        credit=credits,
        grad_norms=grad_norms,
    )


def test_ranks_merge_by_adding_their_sums():
    credits = [credit(100, 2), credit(60, 1)]
    a, b = (
        rank_figures(1, credits, [0.5, 0.7, math.nan]),
        rank_figures(2, credits, [0.5, 0.7, math.nan]),
    )
    merged = a.merge(b)
    assert merged.proximal.tokens == a.proximal.tokens + b.proximal.tokens
    assert merged.proximal.logp_mismatch_max == max(
        a.proximal.logp_mismatch_max, b.proximal.logp_mismatch_max
    )
    assert merged.update == UpdateFigures(83, 6, 3, pytest.approx(0.4), pytest.approx(0.2))
    assert merged.residual == CancellationResidual(6.0, 8.0)
    assert merged.credit == credits and merged.optimizer_updates == 3  # global: kept once
    with pytest.raises(ValueError, match="mini-batches"):
        a.merge(rank_figures(3, credits[:1], [0.5]))


def test_a_rank_extends_its_figures_mini_batch_by_mini_batch():
    first = rank_figures(1, [credit(100, 2)], [0.5, 0.7])
    second = rank_figures(2, [credit(60, 1)], [0.9])
    both = first.extend(second)
    assert both.credit == first.credit + second.credit
    assert both.grad_norms == [0.5, 0.7, 0.9]
    assert both.update.tokens == 83


def test_learner_record_keys_and_values():
    credits = [credit(100, 2), credit(60, 1)]
    ranks = [
        rank_figures(1, credits, [0.5, 0.7, math.nan]),
        rank_figures(2, credits, [0.5, 0.7, math.nan]),
    ]
    record = learner_record(ranks)
    assert record.keys() == LEARNER_KEYS
    total = ranks[0].merge(ranks[1])
    assert record["entropy_mean"] == pytest.approx(total.proximal.entropy / total.proximal.tokens)
    assert record["clip_frac_high"] == pytest.approx(3 / 83)
    assert record["clip_frac"] == pytest.approx(6 / 83 + 3 / 83)
    assert record["approx_kl"] == pytest.approx(0.4 / 83)
    assert record["grad_norm"] == pytest.approx(0.6)  # NaN norms are left out
    assert record["optimizer_updates"] == 3
    assert record["cancellation_residual"] == pytest.approx(6.0 / 8.0)
    assert record["cancellation_residual_whole_group"] == 0.0
    # the step's tokens over its two mini-batches; the passes a mini-batch, averaged
    assert record["valid_tokens"] == 160 and record["optimizer_passes"] == 1.5
    # off-policy figures: sums over both ranks' 21 + 22 tokens, the max over ranks
    assert record["is_weight_mean"] == pytest.approx((22.0 + 23.0) / 43)
    assert record["is_weight_max"] == 3.5
    assert record["is_truncated_frac"] == pytest.approx(3 / 43)
    assert record["is_masked_frac"] == pytest.approx(2 / 43)
    assert record["kl_behaviour_proximal"] == pytest.approx(0.03 / 43)
    assert learner_record([]).keys() == LEARNER_KEYS


def test_rank_figures_survive_pickling():
    figures = rank_figures(4, [credit(10, 1)], [0.25])
    assert pickle.loads(pickle.dumps(figures)) == figures


def test_rollout_figures_split_by_task_only_in_a_job_of_several():
    import random

    from groupflow.core.records import Prompt, Response, SampledGroup, ScoredGroup, Verdict
    from groupflow.observe.rollout_figures import rollout_record

    rng = random.Random()

    def group(task):
        rewards = [float(rng.random() < 0.5) for _ in range(4)]
        responses = [Response([1], "", [0.0]) for _ in rewards]
        prompt = Prompt("u", "", None, task=task)
        return ScoredGroup(
            SampledGroup(prompt, [1], responses, 0), [Verdict(r, "") for r in rewards]
        )

    mixed = [group(rng.choice(["math", "code"])) for _ in range(8)] + [group("math"), group("code")]
    record = rollout_record(mixed, [0] * 40, {})
    for task in ("math", "code"):
        rewards = [r for g in mixed if g.group.prompt.task == task for r in g.rewards]
        assert record["task_reward_mean"][task] == pytest.approx(sum(rewards) / len(rewards))
        assert record["task_accuracy"][task] == pytest.approx(sum(rewards) / len(rewards))
    single = rollout_record([group(None) for _ in range(3)], [0] * 12, {})
    assert "task_reward_mean" not in single and "task_accuracy" not in single


def test_the_record_holds_the_largest_ranks_peak_memory_and_the_smallest_limit():
    credits = [credit(100, 2)]
    ranks = [rank_figures(1, credits, [0.5]), rank_figures(1, credits, [0.5])]
    ranks[0].peak_memory_bytes, ranks[0].memory_limit_bytes = 3 << 30, 6 << 30
    ranks[1].peak_memory_bytes, ranks[1].memory_limit_bytes = 2 << 30, 5 << 30
    record = learner_record(ranks)
    assert record["actor_memory_bytes"] == {"learner": 3 << 30}
    assert record["actor_memory_limit_bytes"] == {"learner": 5 << 30}
