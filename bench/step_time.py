"""Step time, its breakdown and the stages' waits for each other, for trainer.max_staleness
0, 1, 2 and 4 on the same config, with the engines and the learner sharing the cores and
pinned apart.

    .venv/bin/python bench/step_time.py [--steps 8] [--staleness 0 1 2 4] [--set key=value ...]
                                        [--no-pinned]

Prints, per setting, the mean over steps after the first (which pays warm-up), up to the last
`staleness` steps (whose engines have nothing left to draw), of the step time
and of each stage, the tokens generated per second of step time, and the bound the overlap aims
for: max(generation + reward, learning) + sync. The waits: `learner waits` is the learner idle
for want of samples (time_wait_rollout_s); `engines idle` is the time an engine held no chunk,
per engine (time_engines_idle_s). "pinned" runs the engines on core 0 and the learner ranks on
core 1 (rollout/learner.resources.cpu_cores); reward workers stay unpinned.

`--long-tail F` makes the workload of reasoning runs, where response lengths spread widely: in
every sampled group one response is F times longer than the others (F x
rollout.sampling.max_tokens tokens, the others max_tokens, none ending early). `--partial-rollout
on off` measures each setting with in-flight weight loads (rollout.partial_rollout) and without;
`engines idle %` is the engines' idle time as a share of the step.

    .venv/bin/python bench/step_time.py --long-tail 8 --staleness 0 1 2 --partial-rollout on off \
        --no-pinned --steps 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Callable
from copy import copy
from pathlib import Path

import ray

from groupflow.run.driver import run
from groupflow.run.job_config import load_config

STAGES = (
    "time_gen_s",
    "time_reward_s",
    "time_learn_s",
    "time_sync_s",
    "time_step_s",
    "time_wait_rollout_s",
    "time_engines_idle_s",
)
PINNED = ["rollout.resources.cpu_cores=[0]", "learner.resources.cpu_cores=[1]"]


def measure(name: str, staleness: int, steps: int, overrides: list[str], out: Path) -> dict:
    cfg = load_config(  # the built-in quickstart job with the given overrides
        None,
        [
            f"trainer.steps={steps}",
            f"trainer.max_staleness={staleness}",
            f"trainer.output_dir={out}",
            f"trainer.run_name={name}",
            "task.eval_size=16",
            "metrics.progress=false",
            *overrides,
        ],
    )
    run(cfg)
    records = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
    # Step 1 pays warm-up; in the last `staleness` steps the engines have nothing left to draw.
    steady = records[1 : len(records) - staleness] or records
    row = {k: statistics.fmean(r.get(k, 0.0) for r in steady) for k in STAGES}
    row["tokens_per_s"] = statistics.fmean(r["tokens_generated"] / r["time_step_s"] for r in steady)
    row["tokens"] = statistics.fmean(r["tokens_generated"] for r in steady)
    return row


def long_tail(factor: int) -> Callable[[], None]:
    """A setup hook for every Ray worker: vLLM's fan-out of a request of n > 1 (one group) into
    its n sequences gives the first one `factor` times the request's max_tokens and every
    sequence exactly its length. Greedy evaluation (n = 1) is left alone."""

    def install() -> None:
        from vllm.v1.engine.parallel_sampling import ParentRequest

        child_params = ParentRequest._get_child_sampling_params

        def long_tailed(self, index: int):
            params = child_params(self, index)
            if self.sampling_params.n == 1 or self.sampling_params.max_tokens is None:
                return params
            params = copy(params)
            params.max_tokens = self.sampling_params.max_tokens * (factor if index == 0 else 1)
            params.min_tokens = params.max_tokens
            params.ignore_eos = True
            return params

        ParentRequest._get_child_sampling_params = long_tailed

    return install


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--no-pinned", dest="pinned", action="store_false")
    parser.add_argument("--long-tail", type=int, default=None, metavar="F")
    parser.add_argument(
        "--partial-rollout", nargs="+", choices=["default", "on", "off"], default=["default"]
    )
    args = parser.parse_args()
    placements = {"shared": []} | ({"pinned": PINNED} if args.pinned else {})
    partial = {
        "default": [],
        "on": ["rollout.partial_rollout=true"],
        "off": ["rollout.partial_rollout=false"],
    }
    hook = (
        {} if args.long_tail is None else {"worker_process_setup_hook": long_tail(args.long_tail)}
    )
    ray.init(log_to_driver=False, include_dashboard=False, num_cpus=8, runtime_env=hook)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for placement, pins in placements.items():
            for s in args.staleness:
                for mode in args.partial_rollout:
                    name = f"{placement}_staleness{s}_partial-{mode}"
                    overrides = args.overrides + pins + partial[mode]
                    rows[placement, s, mode] = measure(name, s, args.steps, overrides, Path(tmp))
    ray.shutdown()
    print(f"\nstep time breakdown, mean of steps 2..{args.steps} - staleness (seconds)")
    print(
        f"{'cores':>7} {'stale':>5} {'partial':>7} {'gen':>6} {'reward':>6} {'learn':>6} "
        f"{'sync':>6} {'step':>6} {'tokens':>6} {'tok/s':>6} {'bound':>6} {'learner waits':>13} "
        f"{'engines idle':>12} {'idle %':>6}"
    )
    for (placement, s, mode), r in rows.items():
        bound = max(r["time_gen_s"] + r["time_reward_s"], r["time_learn_s"]) + r["time_sync_s"]
        idle = r["time_engines_idle_s"]
        print(
            f"{placement:>7} {s:>5} {mode:>7} {r['time_gen_s']:6.2f} {r['time_reward_s']:6.2f} "
            f"{r['time_learn_s']:6.2f} {r['time_sync_s']:6.2f} {r['time_step_s']:6.2f} "
            f"{r['tokens']:6.0f} {r['tokens_per_s']:6.0f} {bound:6.2f} "
            f"{r['time_wait_rollout_s']:13.2f} {idle:12.2f} {100 * idle / r['time_step_s']:6.1f}"
        )
    base = args.staleness[0]
    for placement in placements:
        for mode in args.partial_rollout:
            for s in args.staleness[1:]:
                speed_up = (
                    rows[placement, base, mode]["time_step_s"]
                    / rows[placement, s, mode]["time_step_s"]
                )
                print(f"{placement}, partial {mode}: staleness {s} against {base}: {speed_up:.2f}x")


if __name__ == "__main__":
    main()
