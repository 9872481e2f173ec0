"""groupflow against TRL's GRPOTrainer on the same model, prompts, group size and lengths.

    .venv/bin/pip install -e ".[bench]"     # TRL: a benchmark dependency only
    .venv/bin/python bench/vs_trl.py [--steps 6] [--workload quickstart|random27m ...]
    .venv/bin/python bench/vs_trl.py --workload random27m --max-tokens 256 --forced --staleness 0 1
        [--trl-step 71.1]     # TRL's step from an earlier run on this machine, not rerun

Two workloads, each run by both systems one after the other in this process's lifetime:
- quickstart: the built-in quickstart model (2.4M parameters), arithmetic prompts, responses of
  a few tokens (the model answers and stops);
- random27m: a random-init 27M-parameter Qwen2 with the quickstart tokenizer, responses of up
  to 64 tokens (a random model rarely stops early).
16 prompts x 8 responses a step, temperature 1, token-mean loss, clip [0.8, 1.28], no KL.
`--max-tokens` sets random27m's response cap and `--forced` makes both systems generate exactly
that many tokens (groupflow's rollout.sampling.ignore_eos, TRL's min_new_tokens), so that the
two learn on the same shapes. groupflow runs once per `--staleness` given (trainer.max_staleness;
TRL has none). Prints the median step time of each (steps after the first, which pays warm-up),
the ratio, groupflow's learn and rollout-wait parts and its largest learner rank's peak memory,
and its learn time against a plain single-process torch step on a batch of the same shape (a
no-grad forward, a forward and backward, an AdamW step): the learner's overhead.
groupflow runs through its CLI (`groupflow train`) with its defaults otherwise, as a user runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from groupflow.core.random_model import random_causal_lm

PROMPTS_PER_STEP = 16
GROUP_SIZE = 8
RANDOM27M = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)
WORKLOADS = {"quickstart": 16, "random27m": 64}  # name -> max response tokens


def quickstart_model() -> Path:
    from groupflow.config import Config
    from groupflow.run.quickstart import quickstart_model_path

    cfg = Config()
    return quickstart_model_path(cfg.task.name, cfg.task.options, cfg.model.warm_start_steps)


def random_model(root: Path) -> Path:
    from groupflow.run.quickstart import build_tokenizer

    tokenizer = build_tokenizer()
    model = random_causal_lm(
        len(tokenizer),
        seed=0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **RANDOM27M,
    )
    path = root / "random27m"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def parameters(path: Path) -> int:
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())


def run_groupflow(
    model: Path, max_tokens: int, forced: bool, staleness: int, steps: int, out: Path
) -> dict:
    overrides = [
        f"model.path={model}",
        f"trainer.steps={steps}",
        f"trainer.output_dir={out}",
        "trainer.run_name=vs_trl",
        f"rollout.prompts_per_step={PROMPTS_PER_STEP}",
        f"rollout.group_size={GROUP_SIZE}",
        f"rollout.sampling.max_tokens={max_tokens}",
        f"rollout.max_model_len={max_tokens + 64}",  # arithmetic prompts are a few tokens
        "task.eval_size=16",
        "metrics.progress=false",
        "algorithm.cancellation_diagnostic=false",
        f"rollout.sampling.ignore_eos={str(forced).lower()}",
        f"trainer.max_staleness={staleness}",
    ]
    command = [sys.executable, "-m", "groupflow.run.cli", "train"]
    for o in overrides:
        command += ["--set", o]
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        sys.exit(f"bench/vs_trl.py: groupflow train failed:\n{done.stderr[-3000:]}")
    records = [
        json.loads(line) for line in (out / "vs_trl" / "metrics.jsonl").read_text().splitlines()
    ]
    steady = records[1:] or records
    return {
        "step_s": statistics.median(r["time_step_s"] for r in steady),
        "learn_s": statistics.median(r["time_learn_s"] for r in steady),
        "gen_s": statistics.median(r["time_gen_s"] for r in steady),
        "wait_s": statistics.median(r["time_wait_rollout_s"] for r in steady),
        "response_len": statistics.fmean(r["response_len_mean"] for r in steady),
        "rank_peak_gb": max(r["actor_memory_bytes"]["learner"] for r in records) / 1e9,
    }


def run_trl(model: Path, max_tokens: int, forced: bool, steps: int, out: Path) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from groupflow.reward_workers.tasks import make_task

    task = make_task("arithmetic", {})
    prompts = task.train_prompts(seed=0)
    rows = [next(prompts) for _ in range(PROMPTS_PER_STEP * (steps + 1))]
    by_text = {p.text: p for p in rows}
    dataset = Dataset.from_list([{"prompt": p.text} for p in rows])

    def reward(prompts, completions, **_):
        return [
            task.verify(by_text[p], c).reward for p, c in zip(prompts, completions, strict=True)
        ]

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []
            self.lengths: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.started)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(logs["completions/mean_length"])

    config = GRPOConfig(
        output_dir=str(out),
        num_generations=GROUP_SIZE,
        per_device_train_batch_size=PROMPTS_PER_STEP * GROUP_SIZE,
        gradient_accumulation_steps=1,
        max_completion_length=max_tokens,
        max_steps=steps,
        learning_rate=1e-4,
        temperature=1.0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",  # token mean over the batch, as groupflow's token_mean
        use_cpu=True,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        gradient_checkpointing=False,
        generation_kwargs={"min_new_tokens": max_tokens} if forced else None,
        shuffle_dataset=False,
        seed=0,
    )
    timer = StepTimes()
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model),
        processing_class=AutoTokenizer.from_pretrained(model),
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        callbacks=[timer],
    )
    trainer.train()
    steady = timer.times[1:] or timer.times
    return {
        "step_s": statistics.median(steady),
        "response_len": statistics.fmean(timer.lengths) if timer.lengths else float("nan"),
    }


def plain_torch_step(model: Path, response_len: float, repeats: int = 3) -> float:
    """Median time of a no-grad forward, a forward+backward and an AdamW step on one padded
    batch of PROMPTS_PER_STEP x GROUP_SIZE sequences of the measured mean length."""
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(model)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-6)
    width = 6 + max(1, round(response_len))  # arithmetic prompts are about 6 characters
    ids = torch.randint(3, net.config.vocab_size, (PROMPTS_PER_STEP * GROUP_SIZE, width))
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        with torch.no_grad():
            net(input_ids=ids).logits.log_softmax(-1)
        loss = net(input_ids=ids).logits.log_softmax(-1).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--workload", nargs="*", choices=sorted(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--max-tokens", type=int, help="random27m's response cap (default 64)")
    parser.add_argument("--forced", action="store_true", help="every response max-tokens long")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0])
    parser.add_argument(
        "--trl-step",
        type=float,
        help="TRL's median step in seconds from an earlier run of the same workload on the "
        "same machine (TRL's step differs from machine to machine by more than 2x; with "
        "--forced): TRL is not run again, its figure is taken as given",
    )
    args = parser.parse_args()
    if args.trl_step is not None and not args.forced:
        parser.error("--trl-step needs --forced: only forced lengths are the same in both runs")
    try:
        import trl  # noqa: F401
    except ImportError:
        sys.exit("bench/vs_trl.py: TRL is not installed; run `.venv/bin/pip install -e '.[bench]'`")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name in args.workload:
            model = quickstart_model() if name == "quickstart" else random_model(root)
            max_tokens = (name == "random27m" and args.max_tokens) or WORKLOADS[name]
            ours = {
                k: run_groupflow(
                    model, max_tokens, args.forced, k, args.steps, root / f"gf-{name}-{k}"
                )
                for k in args.staleness
            }
            if args.trl_step is not None:
                theirs = {"step_s": args.trl_step, "response_len": float(max_tokens)}
            else:
                theirs = run_trl(model, max_tokens, args.forced, args.steps, root / f"trl-{name}")
            torch.set_num_threads(os.cpu_count() or 1)
            plain = plain_torch_step(model, theirs["response_len"])
            params = parameters(model)
            rows += [(name, params, k, gf, theirs, plain) for k, gf in ours.items()]
    print(f"\nmedian step time of steps 2..{args.steps}, {PROMPTS_PER_STEP} prompts x {GROUP_SIZE}")
    print(
        f"{'workload':>10} {'params':>7} {'stale':>5} {'resp gf/trl':>11} {'TRL s':>7} "
        f"{'groupflow s':>11} {'gf/TRL':>7} {'learn s':>7} {'wait s':>6} {'gen s':>6} "
        f"{'rank GB':>7} {'plain s':>7} {'learn/plain':>11} {'plain/TRL':>9}"
    )
    for name, params, k, gf, theirs, plain in rows:
        print(
            f"{name:>10} {params / 1e6:6.1f}M {k:>5} "
            f"{gf['response_len']:5.1f}/{theirs['response_len']:<5.1f} {theirs['step_s']:7.2f} "
            f"{gf['step_s']:11.2f} {gf['step_s'] / theirs['step_s']:7.2f} {gf['learn_s']:7.2f} "
            f"{gf['wait_s']:6.2f} {gf['gen_s']:6.2f} {gf['rank_peak_gb']:7.2f} {plain:7.2f} "
            f"{gf['learn_s'] / plain:11.2f} {plain / theirs['step_s']:9.2f}"
        )


if __name__ == "__main__":
    main()
