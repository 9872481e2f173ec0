"""The gold answer out of a dataset's answer column, when that column holds more than it.

A verifier compares a response's final answer with the whole gold answer. Some datasets keep a
worked solution there instead (GSM8K: reasoning lines, then `#### 72`), which no right answer
equals; such a column is cut to its final answer as it is loaded, by a named layout
(`answer_format`) or by a pattern (`answer_regex`). `worked_solutions` counts the gold answers
that still look like worked solutions, for the warning a task gives at load.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

GSM8K_MARK = "####"
_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d)")


def _gsm8k(text: str) -> str | None:
    """The text after the last `####`, commas inside numbers removed (`1,234` -> `1234`)."""
    _, mark, tail = text.rpartition(GSM8K_MARK)
    if not mark:
        return None
    return _THOUSANDS_COMMA.sub("", tail)


ANSWER_FORMATS: dict[str, Callable[[str], str | None]] = {"gsm8k": _gsm8k}

# `fields: <name>` is short for this mapping (datasets.py reads it).
FIELD_PRESETS: dict[str, dict[str, str]] = {
    "gsm8k": {"prompt": "question", "answer": "answer", "answer_format": "gsm8k"},
}


@dataclass(frozen=True)
class AnswerExtractor:
    """Cuts the gold answer out of an answer column's text; `option` names the setting that
    asked for it, for the messages of the rows it cannot cut."""

    option: str
    find: Callable[[str], str | None]

    def __call__(self, raw: Any) -> str:
        if not isinstance(raw, str):
            raise ValueError(f"{self.option} needs text, got {type(raw).__name__}")
        found = self.find(raw)
        if found is None:
            raise ValueError(f"{self.option} finds no answer in it")
        if not found.strip():
            raise ValueError(f"{self.option} finds an empty answer")
        return found.strip()


def answer_extractor(answer_format: Any, answer_regex: Any) -> AnswerExtractor | None:
    """The extractor that the field mapping's `answer_format` or `answer_regex` asks for (None
    for neither); ValueError naming the key for a bad one, or for both at once."""
    if answer_format is not None and answer_regex is not None:
        raise ValueError("dataset fields: give answer_format or answer_regex, not both")
    if answer_format is not None:
        if answer_format not in ANSWER_FORMATS:
            raise ValueError(
                f"dataset fields: answer_format {answer_format!r} is unknown; use "
                f"{', '.join(ANSWER_FORMATS)}, or answer_regex"
            )
        return AnswerExtractor(f"answer_format {answer_format}", ANSWER_FORMATS[answer_format])
    if answer_regex is not None:
        return AnswerExtractor(f"answer_regex {answer_regex!r}", _last_match(answer_regex))
    return None


def _last_match(pattern: Any) -> Callable[[str], str | None]:
    """Group 1 of the pattern's last match (the whole match when it has no group): a final
    answer comes last, after any number that the reasoning before it mentions."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(
            f"dataset fields: answer_regex must be a regular expression (got {pattern!r})"
        )
    try:
        compiled = re.compile(pattern)
    except re.error as err:
        raise ValueError(
            f"dataset fields: answer_regex {pattern!r} is not a valid regular expression ({err})"
        ) from None
    group = 1 if compiled.groups else 0

    def find(text: str) -> str | None:
        last = collections.deque(compiled.finditer(text), maxlen=1)
        return last[0].group(group) if last else None

    return find


@dataclass(frozen=True)
class WorkedSolutions:
    """How many of `total` gold answers look like worked solutions, and why."""

    total: int
    flagged: int
    with_mark: int  # contain `####`
    multi_line: int
    too_long: int  # so long that the verifier matches only the same text

    def message(self, max_chars: int) -> str:
        signs = {
            f"with {GSM8K_MARK}": self.with_mark,
            "over several lines": self.multi_line,
            f"longer than {max_chars} characters (matched as text only)": self.too_long,
        }
        counts = ", ".join(f"{sign}: {n}" for sign, n in signs.items() if n)
        return (
            f"{self.flagged} of {self.total} gold answers look like worked solutions, not final "
            f"answers ({counts}): the verifier "
            "compares a response's final answer with the whole gold answer, so right answers "
            "may score 0; set fields.answer_format: gsm8k (the text after the last ####; "
            "`fields: gsm8k` for GSM8K's own columns) or fields.answer_regex to load the final "
            "answer alone"
        )


def worked_solutions(
    answers: Iterable[str], matched_as_text_only: Callable[[str], bool]
) -> WorkedSolutions:
    """Counts of the gold answers with `####`, over several lines (white space around them
    aside), or too long for the verifier to compare as more than text."""
    total = flagged = with_mark = multi_line = too_long = 0
    for answer in answers:
        total += 1
        marked, lines = GSM8K_MARK in answer, "\n" in answer.strip()
        long = matched_as_text_only(answer)
        with_mark, multi_line, too_long = with_mark + marked, multi_line + lines, too_long + long
        flagged += marked or lines or long
    return WorkedSolutions(total, flagged, with_mark, multi_line, too_long)
