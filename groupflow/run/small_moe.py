"""A small mixture-of-experts model, built locally the way the quickstart model is (its
character tokenizer, a short supervised warm start on the task, cached by a hash of all that
shapes it; groupflow/run/quickstart.py): transformers' Qwen3-MoE, 8 experts of which each token
takes 2, in 2 layers (docs/moe.md).

    python -m groupflow.run.small_moe     # builds it on first use; prints its directory

and `model.path` set to that directory trains it like any local model.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pydantic import ValidationError

from groupflow.config.job import ModelConfig
from groupflow.core.errors import UserError
from groupflow.run.quickstart import quickstart_model_path

ARCHITECTURE = "qwen3_moe"
# Qwen3-30B-A3B's layout at the quickstart's scale. vLLM's CPU expert kernel takes widths that
# are multiples of 32 (a narrower expert is padded to 32).
SHAPE = dict(
    hidden_size=128,
    moe_intermediate_size=64,
    intermediate_size=256,  # of dense layers (mlp_only_layers): none here
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)


def small_moe_path(
    task_name: str = "arithmetic",
    task_options: dict | None = None,
    warm_start_steps: int | None = None,
    progress: bool = True,
) -> Path:
    """The cached small mixture-of-experts model's directory, built on first use, warm-started
    on `task_name` like the quickstart model (for model.warm_start_steps' default of steps
    unless given)."""
    if warm_start_steps is None:
        warm_start_steps = ModelConfig().warm_start_steps
    return quickstart_model_path(
        task_name, task_options or {}, warm_start_steps, progress, ARCHITECTURE, SHAPE
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m groupflow.run.small_moe",
        description="build (first time) the small Qwen3-MoE model and print its directory",
    )
    parser.add_argument("--task", default="arithmetic", help="the task it is warm-started on")
    parser.add_argument("--warm-start-steps", type=int, help="model.warm_start_steps' default")
    args = parser.parse_args(argv)
    try:
        steps = args.warm_start_steps
        if steps is not None:  # the bounds of model.warm_start_steps
            steps = ModelConfig(warm_start_steps=steps).warm_start_steps
        path = small_moe_path(args.task, {}, steps)
    except ValidationError as err:
        _refuse(parser, f"--warm-start-steps: {err.errors()[0]['msg']}")
    except UserError as err:
        _refuse(parser, str(err))
    except ValueError as err:  # an unknown task: make_task names the choices
        _refuse(parser, f"--task: {str(err).removeprefix('task.name: ')}")
    print(path)


def _refuse(parser: argparse.ArgumentParser, message: str) -> None:
    parser.exit(2, f"{parser.prog}: error: {message}\n")


if __name__ == "__main__":
    main()
