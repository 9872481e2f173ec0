"""A driver of its own on the shared Ray cluster that trains the quickstart on the long-tail
workload (bench/step_time.py `long_tail`: in each group one response FACTOR times as long as
the rest, every response exactly its length) at several staleness bounds, one job each.

    python -m tests.integration.long_tail_driver GCS_ADDRESS OUTPUT_DIR K [K ...]

The workload is a Ray worker setup hook, which only a job's own `ray.init` can set: hence a
process of its own rather than the test's.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import ray

from groupflow.config import build_config
from groupflow.driver import run

FACTOR = 8
MAX_TOKENS = 6  # the short responses; the long one has FACTOR times as many
GROUP_SIZE = 4
PROMPTS_PER_STEP = 8
STEPS = 4


def _long_tail_hook():
    path = Path(__file__).resolve().parents[2] / "bench" / "step_time.py"
    spec = importlib.util.spec_from_file_location("step_time_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench.long_tail(FACTOR)


def main(address: str, output_dir: str, staleness: list[int]) -> None:
    ray.init(
        address=address,
        log_to_driver=False,
        runtime_env={"worker_process_setup_hook": _long_tail_hook()},
    )
    for k in staleness:
        run(
            build_config(
                {},
                [
                    f"trainer.output_dir={output_dir}",
                    f"trainer.run_name=k{k}",
                    f"trainer.steps={STEPS}",
                    f"trainer.max_staleness={k}",
                    f"rollout.group_size={GROUP_SIZE}",
                    f"rollout.prompts_per_step={PROMPTS_PER_STEP}",
                    f"rollout.sampling.max_tokens={MAX_TOKENS}",
                    "task.eval_size=8",
                    "metrics.progress=false",
                ],
            )
        )
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], [int(k) for k in sys.argv[3:]])
