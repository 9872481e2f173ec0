"""What one decode step of a real vLLM engine costs by batch size: the economics behind the
long-tail workload (README, "Engines"). An engine that idles on a chunk's longest response
runs its tail at a small batch; how much that wastes is the cost of a step at that batch
against a full one.

    .venv/bin/python bench/decode_batch.py [--batches 1 8 64 256] [--tokens 128]

Each batch of sequences decodes exactly `--tokens` tokens (no early end) on the quickstart's
built-in model in groupflow's engine (rollout/engine.py), after one untimed run of the same
batch. Prints seconds, milliseconds a decode step and tokens per second for each batch size,
and each step's cost relative to a batch of one.
"""

from __future__ import annotations

import argparse
import time

from groupflow.rollout.engine import RolloutEngine, engine_settings
from groupflow.run.job_config import small_model_config
from groupflow.run.quickstart import quickstart_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    from vllm import SamplingParams

    cfg = small_model_config()
    model = quickstart_model_path(
        cfg.task.name, cfg.task.options, cfg.model.warm_start_steps, progress=False
    )
    engine = RolloutEngine(engine_settings(cfg, str(model), seed=0))  # as the quickstart's
    params = SamplingParams(
        max_tokens=args.tokens, min_tokens=args.tokens, ignore_eos=True, temperature=1.0
    )
    prompt = {"prompt_token_ids": engine.tokenizer.encode("12+34=")}
    print(
        f"{'batch':>5}  {'seconds':>7}  {'ms a step':>9}  {'tokens/s':>8}  {'step vs batch 1':>15}"
    )
    first = None
    for batch in args.batches:
        engine.llm.generate([prompt] * batch, params, use_tqdm=False)  # untimed
        start = time.perf_counter()
        engine.llm.generate([prompt] * batch, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        step_ms = 1000 * seconds / args.tokens
        first = first or step_ms
        print(
            f"{batch:>5}  {seconds:>7.2f}  {step_ms:>9.1f}  {batch * args.tokens / seconds:>8.0f}"
            f"  {step_ms / first:>14.1f}x"
        )


if __name__ == "__main__":
    main()
