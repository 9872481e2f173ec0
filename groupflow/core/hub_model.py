"""`model.path` as a Hugging Face model id: the local snapshot of the model in the Hugging Face
cache, downloaded first on a machine that reaches the hub, read from the cache offline
(`HF_HUB_OFFLINE=1`).

A local directory wins: `model.path` is an id only when no file or directory of that name
exists and it reads as one (`name` or `org/name`, optionally `@revision`: a branch, tag or
commit). Only what a model needs is fetched, from the repository's top level: its JSON files
(config, generation config, tokenizer, the weights' index), tokenizer files of every format,
the chat template, and the weights in safetensors (PyTorch `.bin` files only for a model
without safetensors), not the rest of the repository (other formats, subfolders, images).
"""

from __future__ import annotations

import logging
from pathlib import Path

from groupflow.core.errors import UserError, first_line

log = logging.getLogger(__name__)

# config.json, generation_config.json, tokenizer*.json, vocab.json, added_tokens.json,
# special_tokens_map.json, *.safetensors.index.json; sentencepiece, BPE merges, tiktoken; the
# chat template (chat_template.jinja)
MODEL_FILES = ["*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
SAFETENSORS = ["*.safetensors"]
PYTORCH_WEIGHTS = ["pytorch_model*.bin"]
TOP_LEVEL_ONLY = ["*/*"]  # fnmatch's * crosses "/": this leaves out every subfolder's files


class HubModelError(UserError):
    """A model id that cannot be resolved to a local snapshot."""


def hub_model_id(path: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when `path` names a hub model rather than a local one:
    nothing exists at that path and it reads as an id; None otherwise."""
    if not path or path.startswith((".", "/", "~")) or Path(path).exists():
        return None
    repo_id, _, revision = path.partition("@")
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None
    return repo_id, revision or None


def local_model_path(path: str, key: str = "model.path") -> str:
    """The local directory `path` names: itself, or the snapshot of a hub id; an error names
    `key`, the setting that holds it."""
    found = hub_model_id(path)
    if found is None:
        return path
    repo_id, revision = found
    snapshot = _snapshot(key, path, repo_id, revision, MODEL_FILES + SAFETENSORS)
    if not any(Path(snapshot).glob("*.safetensors")):
        snapshot = _snapshot(key, path, repo_id, revision, MODEL_FILES + PYTORCH_WEIGHTS)
    if not any(Path(snapshot).glob("*.safetensors")) and not any(
        Path(snapshot).glob("pytorch_model*.bin")
    ):
        raise HubModelError(
            f"{key}: {path}: no weights (*.safetensors or pytorch_model*.bin) in {snapshot}"
        )
    log.info("%s %s: the local snapshot %s", key, path, snapshot)
    return snapshot


def _snapshot(key: str, path: str, repo_id: str, revision: str | None, patterns: list[str]) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    get = f"`hf download {repo_id}{f' --revision {revision}' if revision else ''}`"
    try:
        return snapshot_download(
            repo_id, revision=revision, allow_patterns=patterns, ignore_patterns=TOP_LEVEL_ONLY
        )
    except GatedRepoError:
        raise HubModelError(
            f"{key}: {path} is a gated model: accept its terms on "
            f"https://huggingface.co/{repo_id} and set HF_TOKEN to a token of that account"
        ) from None
    except RepositoryNotFoundError:
        raise HubModelError(
            f"{key}: {path}: no such local directory, and no model {repo_id} on the "
            "Hugging Face hub (a private one needs HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise HubModelError(f"{key}: {path}: {repo_id} has no revision {revision}") from None
    except LocalEntryNotFoundError as err:
        why = (
            "the hub is offline (HF_HUB_OFFLINE=1)"
            if constants.HF_HUB_OFFLINE
            else f"the hub cannot be reached ({first_line(err.__cause__ or err, limit=80)})"
        )
        incomplete = "an incomplete copy" if hasattr(err, "snapshot_path") else "not"
        raise HubModelError(
            f"{key}: {path}: no such local directory, {incomplete} in the Hugging Face "
            f"cache ({constants.HF_HUB_CACHE}), and {why}: download it with {get} on a "
            "machine with the network, into this HF_HOME"
        ) from None
    except HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else None
        token = " (HF_TOKEN is not valid)" if status == 401 else ""
        raise HubModelError(
            f"{key}: {path}: the hub refused{token}: {first_line(err, limit=120)}"
        ) from None
