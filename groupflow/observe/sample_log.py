"""What the model wrote: every `trainer.log_samples_every` steps, the step's responses go to
`runs/<name>/samples/step_<N>.jsonl` and a few of them to the progress output as a table."""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

from groupflow.config import TrainerConfig
from groupflow.core.records import Response, ScoredGroup

TABLE_WIDTH = 40  # characters of prompt and response shown per table cell


def sample_rows(
    step: int,
    scored: list[ScoredGroup],
    advantages: list[list[float]],
    decode: Callable[[list[int]], str],
) -> list[dict]:
    """One row per response; `advantages[g][j]` is response j of group g's advantage. The
    prompt is what the model saw: its token ids decoded (after any chat template)."""
    rows = []
    for sg, group_adv in zip(scored, advantages, strict=True):
        prompt = sg.group.prompt
        seen = decode(sg.group.prompt_ids)
        for resp, verdict, adv in zip(sg.group.responses, sg.verdicts, group_adv, strict=True):
            rows.append(
                {
                    "step": step,
                    "uid": prompt.uid,
                    "prompt": seen,
                    "response": resp.text,
                    "reward": verdict.reward,
                    "reason": verdict.reason,
                    "error": verdict.error,
                    "advantage": adv,
                    "length": len(resp.token_ids),
                    "finish_reason": resp.finish_reason,
                    "policy_version": sg.group.policy_version,
                    **({} if resp.end_reason is None else _trajectory(resp, decode)),
                }
            )
    return rows


def _trajectory(resp: Response, decode: Callable[[list[int]], str]) -> dict:
    """A multi-turn response turn by turn: the model's turns and the observations between
    them, each decoded from its own ids, with how it ended and its tool calls."""
    pieces, start = [], 0
    mask = resp.loss_mask or [1] * len(resp.token_ids)
    for end in range(1, len(mask) + 1):
        if end == len(mask) or mask[end] != mask[start]:
            who = "model" if mask[start] else "observation"
            pieces.append({who: decode(resp.token_ids[start:end])})
            start = end
    return {
        "turns": resp.turns,
        "end_reason": resp.end_reason,
        "tool_calls": [f"{u.tool or '?'}: {u.outcome}" for u in resp.tool_uses],
        "trajectory": pieces,
        **({"environment_error": resp.error} if resp.error else {}),
    }


def write_samples(run_dir: Path, step: int, rows: list[dict]) -> Path:
    path = run_dir / "samples" / f"step_{step}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    # ensure_ascii: a model may write lone surrogates, which a UTF-8 file cannot hold.
    path.write_text("".join(json.dumps(row, ensure_ascii=True) + "\n" for row in rows))
    return path


def _cell(value: object) -> str:
    # One printable line, whatever the model wrote (a lone surrogate cannot be printed).
    text = " ".join(str(value).encode("utf-8", "replace").decode().split())
    return text if len(text) <= TABLE_WIDTH else text[: TABLE_WIDTH - 3] + "..."


def sample_table(rows: list[dict], n: int, rng: random.Random) -> str:
    """A few rows, chosen at random, as a plain-text table for the progress output."""
    shown = rng.sample(rows, min(n, len(rows)))
    header = f"{'prompt':<{TABLE_WIDTH}}  {'response':<{TABLE_WIDTH}}  reward  advantage"
    lines = [header, "-" * len(header)]
    for row in shown:
        lines.append(
            f"{_cell(row['prompt']):<{TABLE_WIDTH}}  {_cell(row['response']):<{TABLE_WIDTH}}  "
            f"{row['reward']:6.2f}  {row['advantage']:9.3f}"
        )
    return "\n".join(lines)


class SampleLog:
    """The job's hook: every `trainer.log_samples_every` steps, the step's samples to a file
    and `trainer.log_samples_shown` of them to the progress output."""

    def __init__(self, run_dir: Path, trainer: TrainerConfig, decode: Callable[[list[int]], str]):
        self.run_dir, self.decode = run_dir, decode
        self.every, self.shown = trainer.log_samples_every, trainer.log_samples_shown
        self.rng = random.Random(trainer.seed)

    def __call__(self, step: int, scored: list[ScoredGroup], advantages: list[list[float]]):
        if not self.every or step % self.every:
            return
        rows = sample_rows(step, scored, advantages, self.decode)
        path = write_samples(self.run_dir, step, rows)
        if self.shown:
            from tqdm import tqdm

            table = sample_table(rows, self.shown, self.rng)
            tqdm.write(f"step {step} samples ({path}):\n{table}", file=sys.stderr)
