"""`groupflow score`: score responses from a JSONL file with a task's verifier or a plugin.

Each input line is a JSON object with the prompt fields ("prompt", "answer", optional "uid")
and "response". Every line is checked before anything is scored, so a bad line costs no
work: it gets a one-line error naming file and line, and exit code 2. Output: one JSON line
per response with its reward and reason; a summary goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from groupflow.core.errors import OneLineParser, printable, run_reporting_failures
from groupflow.core.records import Prompt
from groupflow.reward_workers.datasets import (
    BadRow,
    prompt_from_record,
    read_records,
    resolve_fields,
)
from groupflow.reward_workers.scorer import Scorer

EXIT_BAD_INPUT = 2


def main(argv: list[str]) -> int:
    """Score the file; a bad argument, option or line is one line on stderr and exit 2."""
    try:
        return run_reporting_failures(_score, argv, prefix="groupflow score")
    except SystemExit as exit_:  # --help, printed by argparse
        return exit_.code if isinstance(exit_.code, int) else EXIT_BAD_INPUT


def _score(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    options = dict(_parse_option(text) for text in args.option)
    scorer = Scorer(args.task, options, plugin=args.plugin, timeout_s=args.timeout)
    try:
        items = _read_input(args.input, scorer)
        verdicts = scorer.score_stream([(prompt, response) for _, prompt, response in items])
        total = 0.0
        for (line, prompt, _), verdict in zip(items, verdicts, strict=True):
            total += verdict.reward
            out = {
                "line": line,
                "uid": printable(prompt.uid),
                "reward": verdict.reward,
                "reason": printable(verdict.reason),
            }
            if verdict.error is not None:
                out["error"] = verdict.error
            print(json.dumps(out, ensure_ascii=False), flush=True)
    finally:
        scorer.close()
    mean = total / len(items) if items else 0.0
    print(
        f"groupflow score: {len(items)} responses, mean reward {mean:.4f}, "
        f"{scorer.errors} errors, {scorer.timeouts} timeouts",
        file=sys.stderr,
    )
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="groupflow score",
        description="Score responses with a task's verifier or a reward plugin.",
    )
    parser.add_argument("--task", required=True, help="a built-in task name")
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a task option; VALUE is read as JSON when it parses (3, true, [1,2]), else as text",
    )
    parser.add_argument("--input", required=True, help="JSONL file: prompt fields plus 'response'")
    parser.add_argument("--plugin", help="reward plugin 'module:function' or 'file.py:function'")
    parser.add_argument(
        "--timeout", type=float, default=30.0, help="seconds per plugin call (finite, > 0)"
    )
    return parser


def _parse_option(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--option {text!r}: expected KEY=VALUE")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw
    except (ValueError, RecursionError):
        raise ValueError(f"--option {key}: unreadable value") from None


def _read_input(path: str, scorer: Scorer) -> list[tuple[int, Prompt, str]]:
    if not path.endswith(".jsonl"):
        raise ValueError(f"{path}: expected a .jsonl file")
    mapping = resolve_fields(None)
    items = []
    for line, record in read_records(path):
        prompt = prompt_from_record(path, line, record, mapping, scorer.task.parse_answer)
        response = record.get("response")
        if not isinstance(response, str):
            found = (
                "missing" if response is None else f"expected text, got {type(response).__name__}"
            )
            raise BadRow(f"{path}:{line}: field 'response': {found}")
        items.append((line, prompt, response))
    return items
