"""`model.path` as a Hugging Face model id (groupflow/core/hub_model.py), resolved offline from a
cache the test builds: nothing reaches the network."""

from __future__ import annotations

import json

import pytest

from groupflow.config import Config
from groupflow.core.adapters import read_adapter_dir
from groupflow.core.hub_model import (
    MODEL_FILES,
    PYTORCH_WEIGHTS,
    SAFETENSORS,
    TOP_LEVEL_ONLY,
    HubModelError,
    hub_model_id,
    local_model_path,
)
from groupflow.run.inputs import resolve_model_path
from tests.hf_cache import COMMIT, cache_model, read_offline


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    home = tmp_path / "hf"
    read_offline(monkeypatch, home)
    return home


@pytest.fixture
def tiny_model(tmp_path):
    from groupflow.core.random_model import random_causal_lm

    path = tmp_path / "tiny"
    random_causal_lm(32, seed=0).save_pretrained(path)
    return path


def test_a_hub_id_is_its_cached_snapshot_offline(hf_home, tiny_model):
    snapshot = cache_model(hf_home, "org/tiny", tiny_model)
    cfg = Config.model_validate({"model": {"path": "org/tiny"}})
    assert resolve_model_path(cfg) == str(snapshot)
    assert local_model_path(f"org/tiny@{COMMIT}") == str(snapshot)


def test_a_local_directory_of_that_name_wins(hf_home, tiny_model, tmp_path, monkeypatch):
    cache_model(hf_home, "org/tiny", tiny_model)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tiny_model).rename(tmp_path / "org" / "tiny")
    assert local_model_path("org/tiny") == "org/tiny"


@pytest.mark.parametrize("path", ["/models/absent", "./absent", "../absent", "~/absent", "a/b/c"])
def test_a_path_is_never_an_id(path):
    assert hub_model_id(path) is None


def test_an_id_with_a_revision():
    assert hub_model_id("Qwen/Qwen2.5-0.5B-Instruct") == ("Qwen/Qwen2.5-0.5B-Instruct", None)
    assert hub_model_id("gpt2@v1.0") == ("gpt2", "v1.0")


def test_an_id_not_in_the_cache_offline_says_how_to_get_it(hf_home):
    with pytest.raises(HubModelError) as err:
        resolve_model_path(Config.model_validate({"model": {"path": "org/absent@v2"}}))
    (line,) = str(err.value).splitlines()
    assert line.startswith("model.path: org/absent@v2: no such local directory, not in")
    assert "HF_HUB_OFFLINE=1" in line and "`hf download org/absent --revision v2`" in line


def test_an_incomplete_snapshot_offline_is_one_line(hf_home, tiny_model):
    snapshot = cache_model(hf_home, "org/tiny", tiny_model)
    (snapshot / "model.safetensors").unlink()
    with pytest.raises(HubModelError, match=r"^model.path: org/tiny: no weights"):
        local_model_path("org/tiny")


def _refused(status: int, error_name: str):
    import httpx2
    from huggingface_hub import errors

    request = httpx2.Request("GET", "https://huggingface.co/api/models/org/x")
    response = httpx2.Response(status, request=request)
    return getattr(errors, error_name)("refused", response=response)


@pytest.mark.parametrize(
    "status, error, expected",
    [
        (401, "GatedRepoError", "org/x is a gated model: accept its terms on "),
        (404, "RepositoryNotFoundError", "no model org/x on the Hugging Face hub (a private"),
        (404, "RevisionNotFoundError", "org/x has no revision None"),
        (401, "HfHubHTTPError", "the hub refused (HF_TOKEN is not valid)"),
    ],
)
def test_hub_refusals_are_one_line_naming_the_fix(monkeypatch, status, error, expected):
    import huggingface_hub

    def refuse(*args, **kwargs):
        raise _refused(status, error)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(HubModelError) as err:
        local_model_path("org/x")
    (line,) = str(err.value).splitlines()
    assert line.startswith("model.path: org/x") and expected in line
    if error == "GatedRepoError":
        assert "HF_TOKEN" in line


def test_only_the_files_a_model_needs_are_fetched():
    from huggingface_hub.utils import filter_repo_objects

    repo = [
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "tokenizer.model",
        "vocab.json",
        "merges.txt",
        "added_tokens.json",
        "chat_template.jinja",
        "README.md",
        ".gitattributes",
        "LICENSE",
        "figures/benchmark.png",
        "onnx/config.json",
        "onnx/model.onnx",
        "original/params.json",
        "original/consolidated.00.pth",
        "model.gguf",
    ]

    def fetched(weights):
        return set(
            filter_repo_objects(
                repo, allow_patterns=MODEL_FILES + weights, ignore_patterns=TOP_LEVEL_ONLY
            )
        )

    wanted = {
        "config.json",
        "generation_config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "tokenizer.model",
        "vocab.json",
        "merges.txt",
        "added_tokens.json",
        "chat_template.jinja",
    }
    shards = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert fetched(SAFETENSORS) == wanted | shards
    assert fetched(PYTORCH_WEIGHTS) == wanted | {"pytorch_model.bin"}


def test_an_adapter_names_its_base_by_hub_id(hf_home, tiny_model, tmp_path):
    snapshot = cache_model(hf_home, "org/tiny", tiny_model)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps(
            {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "base_model_name_or_path": "org/tiny"}
        )
    )
    assert read_adapter_dir(adapter).base == str(snapshot)
    (adapter / "adapter_config.json").write_text(
        json.dumps(
            {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "base_model_name_or_path": "org/absent"}
        )
    )
    with pytest.raises(
        HubModelError, match=r"adapter_config.json: base_model_name_or_path: org/ab"
    ):
        read_adapter_dir(adapter)
