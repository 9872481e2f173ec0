"""A local Hugging Face cache built by the tests, so that hub model ids and `datasets` names
resolve offline and nothing reaches the network.

huggingface_hub has no offline "put into the cache" API, so a model is laid out as a download
leaves it: HF_HOME/hub/models--ORG--NAME/snapshots/COMMIT/ with refs/main naming COMMIT. A
`datasets` hub dataset is prepared as `load_dataset` prepares a downloaded one (its Parquet
builder under the repository's name), then moved to HF_HOME/datasets/ORG___NAME/, where an
offline `load_dataset` looks.
"""

from __future__ import annotations

import shutil
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def offline_env(hf_home: Path) -> dict[str, str]:
    """The environment of a process that reads the cache under `hf_home` offline."""
    return {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def cache_model(hf_home: Path, repo_id: str, files_from: Path, commit: str = COMMIT) -> Path:
    """Place the files of the model directory `files_from` in the cache as the snapshot
    `commit` of `repo_id`, its main branch; returns the snapshot directory."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(files_from, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def cache_dataset(hf_home: Path, repo_id: str, config: str, splits: dict[str, Path]) -> None:
    """Prepare the Parquet files of `splits` ({split: file}) as config `config` of the hub
    dataset `repo_id`, as an online `load_dataset(repo_id, config)` leaves it in the cache."""
    from datasets.packaged_modules.parquet.parquet import Parquet

    namespace, name = repo_id.split("/")
    build = hf_home / "datasets-build"
    Parquet(
        cache_dir=str(build),
        dataset_name=name,
        config_name=config,
        config_id=config,
        data_files={split: str(file) for split, file in splits.items()},
        hash="0123abcd",
    ).download_and_prepare()
    target = hf_home / "datasets" / f"{namespace}___{name}"
    target.mkdir(parents=True, exist_ok=True)
    shutil.move(build / name / config, target / config)
    shutil.rmtree(build)


def read_offline(monkeypatch, hf_home: Path) -> None:
    """Make this process read the cache under `hf_home` offline (both libraries read their
    environment once, at import)."""
    import datasets.config
    from huggingface_hub import constants

    for name, value in offline_env(hf_home).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", hf_home / "datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
