"""Dataset entries that are not files: a `datasets` hub name, or a directory saved with
`Dataset.save_to_disk` / `DatasetDict.save_to_disk`.

- `NAME`, `NAME:SPLIT` or `NAME:CONFIG:SPLIT` names a dataset on the Hugging Face hub
  (`openai/gsm8k:main:train`), loaded with `datasets.load_dataset`: downloaded and prepared
  in the datasets cache (HF_HOME) where the hub is reachable, read from that cache offline
  (`HF_HUB_OFFLINE=1`). SPLIT may slice, as `datasets` reads it (`train[:1000]`).
- `DIR` or `DIR:SPLIT` names a saved directory; a saved DatasetDict needs its split.
Without a split, the dataset's only split is read; a dataset of several is refused, naming
them. An existing file or directory always wins over a hub name of the same spelling.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from groupflow.core.errors import first_line

SYNTAX = "a hub dataset is NAME, NAME:SPLIT or NAME:CONFIG:SPLIT"
FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".pq")


def dataset_records(spec: str) -> Iterator[tuple[int, Any]] | None:
    """(row number from 1, row) of the saved directory or hub dataset `spec` names; None when
    it names neither (a file path, to be reported missing)."""
    directory, split = spec, None
    if not Path(spec).is_dir() and ":" in spec:
        directory, split = spec.rsplit(":", 1)
    if Path(directory).is_dir():
        return _rows(spec, _saved(spec, directory, split), split)
    hub = hub_dataset_name(spec)
    if hub is None:
        return None
    name, config, split = hub
    return _rows(spec, _from_hub(spec, name, config, split), None)  # the split is applied


def hub_dataset_name(spec: str) -> tuple[str, str | None, str | None] | None:
    """(name, config, split) of a hub dataset spec; None for what reads as a file path (also
    what `groupflow submit` needs to tell a hub name from a relative path)."""
    if spec.startswith((".", "/", "~")) or spec.lower().endswith(FILE_SUFFIXES):
        return None
    head, bracket, slicing = spec.partition("[")  # a split's slice may hold ":" (train[:100])
    parts = head.split(":")
    if len(parts) > 3 or (bracket and len(parts) == 1):
        return None
    parts[-1] += bracket + slicing
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(parts[0])
    except HFValidationError:
        return None
    name, rest = parts[0], parts[1:]
    config = rest[0] if len(rest) == 2 else None
    split = rest[-1] if rest else None
    return name, config or None, split or None


def _saved(spec: str, directory: str, split: str | None):
    import datasets

    try:
        loaded = datasets.load_from_disk(directory)
    except FileNotFoundError:
        raise ValueError(
            f"{spec}: a directory, but neither a dataset saved with save_to_disk nor a file "
            "(use .jsonl or .parquet)"
        ) from None
    except Exception as err:  # datasets raises several types for an unreadable directory
        raise ValueError(f"{spec}: not a readable saved dataset ({first_line(err)})") from None
    if split is not None and not isinstance(loaded, datasets.DatasetDict):
        raise ValueError(f"{spec}: {directory} holds one dataset, without splits: name it alone")
    return loaded


def _from_hub(spec: str, name: str, config: str | None, split: str | None):
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    try:
        return datasets.load_dataset(name, config, split=split)
    except ConnectionError:
        where = "HF_HUB_OFFLINE=1" if datasets.config.HF_HUB_OFFLINE else "the hub is unreachable"
        raise ValueError(
            f"{spec}: no such file, and no dataset {name} in the datasets cache "
            f"({datasets.config.HF_DATASETS_CACHE}) with {where}: load it once where the hub "
            "is reachable, with this HF_HOME (e.g. the same groupflow command)"
        ) from None
    except DatasetNotFoundError as err:
        raise ValueError(
            f"{spec}: no such file, and {first_line(err)} (a private or gated dataset needs "
            "HF_TOKEN)"
        ) from None
    except Exception as err:  # unknown split or config, bad slice: datasets' own types vary
        raise ValueError(f"{spec}: {first_line(err, limit=200)} ({SYNTAX})") from None


def _rows(spec: str, loaded, split: str | None) -> Iterator[tuple[int, Any]]:
    import datasets

    if isinstance(loaded, datasets.DatasetDict):
        names = ", ".join(loaded)
        if split is None and len(loaded) != 1:
            raise ValueError(f"{spec}: several splits ({names}): name one, {spec}:SPLIT")
        if split is not None and split not in loaded:
            raise ValueError(f"{spec}: no split {split!r} (it has {names})")
        loaded = loaded[split] if split is not None else next(iter(loaded.values()))
    return enumerate(iter(loaded), start=1)
