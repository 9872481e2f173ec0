"""`groupflow` command line: train, and the tools around a run."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from groupflow.errors import OneLineParser, run_reporting_failures
from groupflow.jobs import JOB_COMMANDS, add_job_commands, run_job_handler

EPILOG = """examples:
  groupflow train                                   the built-in quickstart job
  groupflow train job.yaml --set learner.optimizer.lr=1e-5 --set rollout.group_size=8
  groupflow train --set algorithm.preset=stapo --set trainer.steps=50
  groupflow train job.yaml --resume                 go on from the run's newest checkpoint
  groupflow scale quickstart --engines 2             two engines for the running job `quickstart`
  groupflow status quickstart                       its live engines, reward workers, learner ranks
"""


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="YAML config file (default: the built-in quickstart)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key, e.g. --set rollout.group_size=8 (repeatable; values are YAML)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="groupflow",
        description="RL from verifiable sequence-level rewards with token-level credit control, on Ray.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train",
        help="run a training job",
        description="Run a training job on a local Ray cluster or on cluster.address. "
        "Writes runs/<trainer.run_name>/: config.resolved.yaml, metrics.jsonl, driver.log, model/, "
        "summary.json "
        "(and checkpoints/ with trainer.checkpoint_every).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_config_args(train)
    train.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        metavar="PATH",
        help="continue from the run directory's newest checkpoint, or from the checkpoint "
        "directory PATH (sets trainer.resume)",
    )
    evaluate = sub.add_parser(
        "eval",
        help="held-out greedy accuracy of a model on the config's task",
        description="Greedy accuracy on task.eval_size held-out prompts of task.name, with one "
        "vLLM engine in this process. Prints one JSON line.",
    )
    _add_config_args(evaluate)
    evaluate.add_argument(
        "--model",
        help="Hugging Face model directory, or a LoRA adapter in PEFT's format (served on "
        "the base model its adapter_config.json names); default: model.path",
    )
    show = sub.add_parser("config", help="print the resolved config (defaults + file + overrides)")
    _add_config_args(show)
    add_job_commands(sub)
    # `score` parses its own arguments (reward_workers/score_cli.py); listed here for --help.
    sub.add_parser(
        "score",
        add_help=False,
        help="score a JSONL file of responses with a task's verifier or a plugin "
        "(groupflow score --help)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; every expected failure ends as one line and a non-zero exit
    (groupflow/errors.py), a traceback only for a bug."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["score"]:
        from groupflow.reward_workers.score_cli import main as score_main

        return score_main(argv[1:])
    return run_reporting_failures(_run_command, argv)


def _run_command(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.command in JOB_COMMANDS:
        return run_job_handler(args)
    from groupflow.config import load_config

    overrides = list(args.overrides)
    if getattr(args, "resume", None):
        overrides.append(f"trainer.resume={args.resume}")
    if getattr(args, "model", None):
        overrides.append(f"model.path={args.model}")
    cfg = load_config(args.config, overrides)
    if args.command == "config":
        print(cfg.dump_yaml(), end="")
        return 0

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from groupflow.driver import resolve_model_path, run

    if args.command == "eval":
        from groupflow.adapters import is_adapter_dir
        from groupflow.evaluate import evaluate_model

        path = cfg.model.path
        adapter = path is not None and is_adapter_dir(path)
        print(json.dumps(evaluate_model(cfg, path if adapter else resolve_model_path(cfg))))
        return 0
    summary = run(cfg)
    print(
        f"done: held-out accuracy {summary['warm_start_accuracy']:.3f} -> {summary['final_accuracy']:.3f}; "
        f"run directory {cfg.trainer.output_dir}/{cfg.trainer.run_name}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
