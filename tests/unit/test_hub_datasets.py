"""Dataset entries that are `datasets` hub names or directories saved with save_to_disk
(reward_workers/hub_datasets.py), read through the same loader as files; the hub's are
read offline from a cache the test builds: nothing reaches the network."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from groupflow.reward_workers.datasets import load_prompts
from groupflow.reward_workers.tasks import make_task
from tests.hf_cache import cache_dataset, read_offline

GSM8K = {"prompt": "question", "answer": "answer"}


def _rows(n: int, start: int = 0) -> dict[str, list]:
    return {
        "question": [f"What is {i} + {i}?" for i in range(start, start + n)],
        "answer": [str(2 * i) for i in range(start, start + n)],
    }


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    home = tmp_path / "hf"
    read_offline(monkeypatch, home)
    files = {}
    for split, (n, start) in {"train": (6, 0), "test": (3, 100)}.items():
        files[split] = tmp_path / f"{split}.parquet"
        pq.write_table(pa.table(_rows(n, start)), files[split])
    cache_dataset(home, "openai/gsm8k", "main", files)
    return home


def _answers(spec: str) -> list:
    return [p.answer for p in load_prompts(spec, GSM8K).prompts]


def test_a_hub_dataset_by_name_config_and_split_offline(hf_home):
    assert _answers("openai/gsm8k:main:train") == ["0", "2", "4", "6", "8", "10"]
    assert _answers("openai/gsm8k:main:test") == ["200", "202", "204"]
    assert _answers("openai/gsm8k:main:train[:2]") == ["0", "2"]
    (first, *_) = load_prompts("openai/gsm8k:main:train", GSM8K).prompts
    assert first.text == "What is 0 + 0?" and first.uid == "gsm8k:main:train:1"


def test_a_math_task_trains_and_evaluates_on_hub_splits(hf_home):
    task = make_task(
        "math",
        {
            "dataset": "openai/gsm8k:main:train",
            "eval_dataset": "openai/gsm8k:main:test",
            "fields": GSM8K,
        },
    )
    assert len(task.eval_prompts(10)) == 3


def test_hub_dataset_mistakes_are_one_line(hf_home):
    cases = {
        "openai/gsm8k": "several splits (train, test): name one, openai/gsm8k:SPLIT",
        "openai/gsm8k:main": 'Unknown split "main". Should be one of',  # NAME:SPLIT
        "openai/gsm8k:main:validation": 'Unknown split "validation"',
        "openai/gsm8k:socratic:train": "Couldn't find cache for openai/gsm8k for config",
        "openai/absent:train": "no such file, and no dataset openai/absent in the datasets cache",
    }
    for spec, expected in cases.items():
        with pytest.raises(ValueError) as err:
            load_prompts(spec, GSM8K)
        (line,) = str(err.value).splitlines()
        assert line.startswith(f"{spec}: ") and expected in line, line
        if "Unknown split" in line:
            assert line.endswith("(a hub dataset is NAME, NAME:SPLIT or NAME:CONFIG:SPLIT)")
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE=1: load it once where the hub"):
        load_prompts("openai/absent:train", GSM8K)


def test_a_path_is_never_a_hub_name(hf_home):
    for path in ["./openai/gsm8k", "/data/gsm8k", "data/train.jsonl", "a/b/c"]:
        with pytest.raises(ValueError, match=r"^.*: no such file$"):
            load_prompts(path, GSM8K)


def test_saved_datasets_and_their_splits(tmp_path):
    from datasets import Dataset, DatasetDict

    Dataset.from_dict(_rows(4)).save_to_disk(tmp_path / "one")
    DatasetDict(
        {"train": Dataset.from_dict(_rows(4)), "test": Dataset.from_dict(_rows(2, 50))}
    ).save_to_disk(tmp_path / "both")
    assert _answers(str(tmp_path / "one")) == ["0", "2", "4", "6"]
    assert _answers(f"{tmp_path / 'both'}:test") == ["100", "102"]
    refused = {
        f"{tmp_path / 'both'}": "several splits (train, test): name one",
        f"{tmp_path / 'both'}:dev": "no split 'dev' (it has train, test)",
        f"{tmp_path / 'one'}:train": "holds one dataset, without splits: name it alone",
        f"{tmp_path}": "a directory, but neither a dataset saved with save_to_disk nor a file",
    }
    for spec, expected in refused.items():
        with pytest.raises(ValueError) as err:
            load_prompts(spec, GSM8K)
        (line,) = str(err.value).splitlines()
        assert line.startswith(f"{spec}: ") and expected in line, line
