"""Where STAPO's probability threshold falls on long_addition, and what each tau_p silences.

    .venv/bin/python bench/stapo_threshold.py [--steps 8] [--prompts 16] [--group 8]
        [--warm-start-steps 200] [--seed 0]

Samples `--steps` steps of `--prompts` x `--group` responses from the warm-started
long_addition model (docs/long_addition.md; built and cached on first use) at temperature 1,
scores them with the task's verifier, takes GRPO advantages per group, computes the learner's
token statistics (log-prob, entropy, sum p^2 through the learner's own token head,
learner/token_head.py) and plans each step as one mini-batch with the learner's
`plan_credit`, once per STAPO setting: fixed thresholds, and `tau_p: auto` at several target
shares with its running histogram carried across the steps. Prints, per setting, the
threshold, the examined tokens below it (STAPO's candidates, before its entropy quantile),
on how many steps, the steps with a spurious token, `spurious_frac` as the step record has it, and
how many of the spurious tokens are the task's rare separators (the harmless improbable
choices STAPO is about) rather than digits the policy was unsure of. The policy is held
fixed (no update), so the figures describe the warm-started policy, not a run; no Ray, no
engine (transformers' sampler, the learner's statistics).
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field

import torch

from groupflow.learner.advantages import GroupIndex, grpo_advantages
from groupflow.learner.auto_threshold import RunningProbabilityThreshold
from groupflow.learner.credit import LocalReducer, MiniBatchTokens, plan_credit
from groupflow.learner.token_head import (
    install_token_head,
    response_positions,
    response_token_stats,
)
from groupflow.reward_workers.tasks.long_addition import SEPARATORS, LongAdditionTask
from groupflow.run.job_config import build_config
from groupflow.run.quickstart import quickstart_model_path

FIXED = [0.002, 0.01, 0.05, 0.1, 0.3]
TARGET_SHARES = [0.001, 0.003, 0.01]
RARE_SEPARATORS = {s for s, _ in SEPARATORS if s != " "}


@dataclass
class Step:
    tokens: MiniBatchTokens
    chars: list[list[str]]  # each response's tokens as text, padded with ""
    accuracy: float


def sample_step(sampler, learner, tokenizer, task, prompts, group: int, max_tokens: int) -> Step:
    """One step's groups: sampled, scored, with the learner's statistics of every token (the
    same weights twice: `learner` has the learner's token head, `sampler` the plain one)."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    encoded = [tokenizer.encode(p.text) for p in prompts]
    if len({len(e) for e in encoded}) != 1:
        raise ValueError("long_addition prompts of one digit count are one length")
    prompt_ids = torch.tensor(encoded)
    with torch.no_grad():
        out = sampler.generate(
            input_ids=prompt_ids,
            attention_mask=torch.ones_like(prompt_ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_tokens,
            num_return_sequences=group,
            eos_token_id=eos,
            pad_token_id=pad,
        )
    prompt_len = prompt_ids.shape[1]
    responses = []
    for row in out[:, prompt_len:].tolist():
        # up to and with the eos, as the engine returns a finished response
        responses.append(row[: row.index(eos) + 1] if eos in row else row)
    rewards = torch.tensor(
        [
            task.verify(prompts[i // group], tokenizer.decode(r, skip_special_tokens=True)).reward
            for i, r in enumerate(responses)
        ],
        dtype=torch.float64,
    )
    group_ids = torch.arange(len(responses)) // group
    advantages = grpo_advantages(rewards, GroupIndex.of(group_ids))

    width = prompt_len + max(map(len, responses))
    ids = torch.full((len(responses), width), pad)
    for i, r in enumerate(responses):
        ids[i, : prompt_len + len(r)] = torch.tensor(encoded[i // group] + r)
    lengths = [prompt_len + len(r) for r in responses]
    positions = response_positions(ids, lengths, [prompt_len] * len(responses))
    attention = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    with torch.no_grad():
        stats = response_token_stats(learner, ids, attention, positions, temperature=1.0)
    longest = max(map(len, responses))
    mask = torch.zeros(len(responses), longest, dtype=torch.float64)
    logp, entropy, sum_p2 = (torch.zeros_like(mask) for _ in range(3))
    for i, s in enumerate(stats.split(positions.sizes)):
        n = len(responses[i])
        mask[i, :n] = 1.0
        logp[i, :n], entropy[i, :n], sum_p2[i, :n] = s.logp, s.entropy, s.sum_p2
    chars = [[tokenizer.decode([t]) for t in r] + [""] * (longest - len(r)) for r in responses]
    tokens = MiniBatchTokens(
        mask, logp, logp, entropy, entropy, sum_p2, advantages.to(torch.float64), group_ids
    )
    return Step(tokens, chars, float(rewards.mean()))


@dataclass
class Setting:
    name: str
    tau_p: float | str
    target_share: float = 0.01
    auto: RunningProbabilityThreshold | None = None
    thresholds: list[float] = field(default_factory=list)
    spurious_frac: list[float] = field(default_factory=list)
    candidates: int = 0  # examined tokens below the threshold (before the entropy quantile)
    candidate_steps: int = 0  # steps with one at least
    spurious: int = 0
    separators: int = 0

    def plan(self, step: Step) -> None:
        cfg = build_config(
            {
                "algorithm": {
                    "stapo": {
                        "enabled": True,
                        "tau_p": self.tau_p,
                        "target_share": self.target_share,
                    }
                }
            }
        ).algorithm
        plan = plan_credit(step.tokens, cfg, LocalReducer(), self.auto)
        self.thresholds.append(plan.stats.stapo_tau_p)
        self.spurious_frac.append(plan.stats.spurious_frac)
        tokens = step.tokens
        examined = (tokens.mask > 0) & (tokens.advantages[:, None] > 0)
        below = int((examined & (tokens.cur_logp.exp() < plan.stats.stapo_tau_p)).sum())
        self.candidates += below
        self.candidate_steps += below > 0
        silenced = (plan.passes[0] == 0) & (step.tokens.mask > 0)
        for row, col in torch.nonzero(silenced).tolist():
            self.spurious += 1
            self.separators += step.chars[row][col] in RARE_SEPARATORS


def settings() -> list[Setting]:
    out = [Setting(f"tau_p {t}", t) for t in FIXED]
    for share in TARGET_SHARES:
        alg = build_config({}).algorithm.stapo
        auto = RunningProbabilityThreshold(share, alg.auto_decay)
        out.append(Setting(f"auto, target_share {share}", "auto", share, auto))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--warm-start-steps", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = quickstart_model_path("long_addition", {}, args.warm_start_steps, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    sampler, learner = (
        AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
        for _ in range(2)
    )
    install_token_head(learner)
    task = LongAdditionTask()
    prompts = task.train_prompts(args.seed)
    torch.manual_seed(args.seed)
    steps = []
    for _ in range(args.steps):
        step_prompts = [next(prompts) for _ in range(args.prompts)]
        steps.append(
            sample_step(
                sampler, learner, tokenizer, task, step_prompts, args.group, args.max_tokens
            )
        )

    examined_p, examined_chars = [], []
    for step in steps:
        examined = (step.tokens.mask > 0) & (step.tokens.advantages[:, None] > 0)
        examined_p.append(step.tokens.cur_logp.exp()[examined])
        examined_chars += [step.chars[r][c] for r, c in torch.nonzero(examined).tolist()]
    p = torch.cat(examined_p)
    valid = sum(int(s.tokens.mask.sum()) for s in steps)
    rare = torch.tensor([c in RARE_SEPARATORS for c in examined_chars])
    print(
        f"{len(steps)} steps x {args.prompts} prompts x {args.group} responses, warm start "
        f"{args.warm_start_steps} steps; sampled accuracy "
        f"{statistics.fmean(s.accuracy for s in steps):.3f}; {valid} response tokens, "
        f"{len(p)} examined by STAPO (positive advantage), {int(rare.sum())} of them rare "
        "separators"
    )
    print("share of the examined tokens below p (rare separators among them):")
    for t in [0.002, 0.01, 0.05, 0.1, 0.3, 0.5]:
        below = p < t
        print(f"  p < {t:<5}  {float(below.double().mean()):.2e}  ({int((below & rare).sum())})")

    print(
        f"\n{'setting':<26} {'tau_p (mean)':>12} {'candidates (steps)':>19} {'steps > 0':>10} "
        f"{'spurious_frac':>14} {'spurious':>9} {'separators':>11}"
    )
    for setting in settings():
        for step in steps:
            setting.plan(step)
        active = sum(f > 0 for f in setting.spurious_frac)
        print(
            f"{setting.name:<26} {statistics.fmean(setting.thresholds):>12.3g} "
            f"{setting.candidates:>11} ({setting.candidate_steps:>2} of {len(steps):<2}) "
            f"{active:>3} of {len(steps):<2} {statistics.fmean(setting.spurious_frac):>14.2e} "
            f"{setting.spurious:>9} {setting.separators:>11}"
        )


if __name__ == "__main__":
    main()
