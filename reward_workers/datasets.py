"""Prompts from a dataset file: JSONL (one object a line) or Parquet, with a field mapping; or
from a `datasets` hub name or a directory saved with `save_to_disk` (reward_workers/hub_datasets.py).

The mapping says which column holds each of our fields, e.g. {"prompt": "question",
"answer": "solution"}; a dotted name reaches into nested objects ("reward_model.ground_truth").
Its `answer_format` or `answer_regex` cuts the gold answer out of an answer column that holds
more (a worked solution: reward_workers/gold_answers.py); a preset's name stands for a whole
mapping (`"gsm8k"`).
A prompt is text (`prompt`) or a conversation (`messages`: a list of {"role", "content"}
objects, for chat models).
A malformed row stops loading with a one-line ValueError naming file, line and field, or,
with skip_bad=True, is skipped and counted.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from groupflow.core.errors import first_line, printable
from groupflow.core.records import Prompt
from groupflow.reward_workers.gold_answers import FIELD_PRESETS, AnswerExtractor, answer_extractor
from groupflow.reward_workers.hub_datasets import dataset_records

FIELDS = ("prompt", "messages", "answer", "uid")
ANSWER_KEYS = ("answer_format", "answer_regex")  # how to cut the gold answer out of its column
REQUIRED_FIELDS = ("answer",)
ROLES = ("system", "user", "assistant")
MAX_UID_DIGITS = 100


class BadRow(ValueError):
    """One malformed row; str() is the one-line message naming file, line and field."""


@dataclass(frozen=True)
class FieldMapping:
    columns: dict[str, str]  # our field -> the file's column
    extract_answer: AnswerExtractor | None = None  # the gold answer out of the answer column


@dataclass
class LoadedPrompts:
    prompts: list[Prompt]
    skipped: int


def load_prompts(
    path: str | Path,
    fields: Mapping[str, str] | str | None = None,
    *,
    skip_bad: bool = False,
    parse_answer: Callable[[Any], Any] | None = None,
) -> LoadedPrompts:
    """Read every row of the file as a Prompt; parse_answer validates/converts the answer."""
    mapping = resolve_fields(fields)
    prompts, skipped = [], 0
    for line, record in read_records(path):
        try:
            prompts.append(prompt_from_record(path, line, record, mapping, parse_answer))
        except BadRow:
            if not skip_bad:
                raise
            skipped += 1
    return LoadedPrompts(prompts, skipped)


def resolve_fields(fields: Mapping[str, str] | str | None) -> FieldMapping:
    """Each of our fields' column, defaulting to the field's own name, and the answer's
    extractor; `fields` is a mapping or a preset's name."""
    if isinstance(fields, str):
        if fields not in FIELD_PRESETS:
            raise ValueError(
                f"dataset fields: unknown preset {fields!r}; use {', '.join(FIELD_PRESETS)}, "
                "or a mapping such as {prompt: question, answer: solution}"
            )
        fields = FIELD_PRESETS[fields]
    if fields is not None and not isinstance(fields, Mapping):
        raise ValueError(f"dataset fields: expected a mapping or a preset name, got {fields!r}")
    fields = dict(fields or {})
    extract = answer_extractor(*(fields.pop(key, None) for key in ANSWER_KEYS))
    columns = {name: name for name in FIELDS}
    for key, column in fields.items():
        if key not in FIELDS:
            raise ValueError(
                f"dataset fields: unknown key {key!r}; use {', '.join(FIELDS + ANSWER_KEYS)}"
            )
        if not isinstance(column, str) or not column:
            raise ValueError(f"dataset fields: {key!r} must name a column (got {column!r})")
        columns[key] = column
    return FieldMapping(columns, extract)


def read_records(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(line or row number from 1, record) for each row; a record that is not valid JSON
    arrives as a BadRow instance so that callers decide whether to stop or skip."""
    spec, path = str(path), Path(path)
    if not path.is_file():
        rows = dataset_records(spec)  # a saved directory or a hub dataset
        if rows is None:
            raise ValueError(f"{path}: no such file")
        return rows
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return _jsonl_records(path)
    if suffix in (".parquet", ".pq"):
        return _parquet_records(path)
    raise ValueError(f"{path}: unknown dataset format (use .jsonl or .parquet)")


def prompt_from_record(
    path: str | Path,
    line: int,
    record: Any,
    mapping: FieldMapping,
    parse_answer: Callable[[Any], Any] | None = None,
) -> Prompt:
    if isinstance(record, BadRow):
        raise record
    if not isinstance(record, dict):
        raise BadRow(f"{path}:{line}: expected an object, got {type(record).__name__}")

    def fail(field: str, problem: str) -> BadRow:
        return BadRow(f"{path}:{line}: field {mapping.columns[field]!r} ({field}): {problem}")

    values = {}
    for field in FIELDS:
        found, value = _lookup(record, mapping.columns[field])
        if not found or value is None:
            if field in REQUIRED_FIELDS:
                raise fail(field, "missing")
            continue
        values[field] = value
    messages = None
    if "messages" in values:
        messages = _messages(values["messages"], fail)
        text = ""
    elif "prompt" in values:
        text = values["prompt"]
        if not isinstance(text, str) or not text.strip():
            raise fail("prompt", f"expected non-empty text, got {_describe(text)}")
    else:
        raise fail("prompt", "missing (a prompt or a list of messages is needed)")
    answer = values["answer"]
    if mapping.extract_answer is not None:
        try:
            answer = mapping.extract_answer(answer)
        except ValueError as err:
            raise fail("answer", str(err)) from None
    if parse_answer is not None:
        try:
            answer = parse_answer(answer)
        except (ValueError, TypeError) as err:
            raise fail("answer", first_line(err, limit=120)) from None
        except RecursionError:
            raise fail("answer", "nested too deeply") from None
    uid = values.get("uid", f"{Path(path).name}:{line}")
    if not isinstance(uid, str | int) or isinstance(uid, bool):
        raise fail("uid", f"expected text or an integer, got {_describe(uid)}")
    if isinstance(uid, int) and abs(uid) >= 10**MAX_UID_DIGITS:
        raise fail("uid", f"integer longer than {MAX_UID_DIGITS} digits")
    return Prompt(uid=str(uid), text=text, answer=answer, messages=messages)


def _messages(value: Any, fail: Callable[[str, str], BadRow]) -> list[dict]:
    """A conversation: {"role", "content"} objects with a known role, at least one user turn."""
    if not isinstance(value, list) or not value:
        raise fail("messages", f"expected a non-empty list of messages, got {_describe(value)}")
    turns = []
    for i, turn in enumerate(value):
        if not isinstance(turn, dict) or turn.get("role") not in ROLES:
            raise fail("messages", f"message {i}: expected a role of {'/'.join(ROLES)}")
        content = turn.get("content")
        if not isinstance(content, str):
            raise fail("messages", f"message {i}: content must be text, got {_describe(content)}")
        turns.append({"role": turn["role"], "content": content})
    if not any(t["role"] == "user" for t in turns):
        raise fail("messages", "no user message")
    return turns


def _jsonl_records(path: Path) -> Iterator[tuple[int, Any]]:
    with path.open("rb") as f:
        for line, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                record = BadRow(f"{path}:{line}: not valid UTF-8")
            except json.JSONDecodeError as err:
                record = BadRow(f"{path}:{line}: not valid JSON ({err.msg})")
            except RecursionError:
                record = BadRow(f"{path}:{line}: JSON nested too deeply")
            except ValueError as err:  # e.g. an integer past Python's int-str digit limit
                record = BadRow(f"{path}:{line}: unreadable JSON ({first_line(err, limit=120)})")
            yield line, record


def _parquet_records(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq  # only datasets in Parquet pay for the import

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=1024)
        row = 0
        for batch in batches:
            for record in batch.to_pylist():
                row += 1
                yield row, record
    except Exception as err:  # pyarrow raises several types for unreadable files
        raise ValueError(f"{path}: not a readable Parquet file ({first_line(err)})") from None


def _lookup(record: dict, column: str) -> tuple[bool, Any]:
    if column in record:
        return True, record[column]
    value: Any = record
    for part in column.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def _describe(value: Any) -> str:
    try:
        text = repr(value)
    except ValueError:  # an integer past the int-str digit limit
        text = f"a {type(value).__name__} too large to show"
    text = printable(text)
    return text if len(text) <= 40 else text[:37] + "..."
