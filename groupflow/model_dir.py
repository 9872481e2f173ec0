"""A model directory the user names (`model.path`, `groupflow eval --model`): its config.json
read and checked to be a JSON object before anything loads the model, which would fail late
and at length."""

from __future__ import annotations

import json
from pathlib import Path

from groupflow.errors import UserError, first_line

MAX_MODEL_CONFIG_BYTES = 16 << 20


class ModelDirError(UserError):
    """A model directory whose config.json cannot be read."""


def read_model_config(model_path: str | Path) -> dict:
    path = Path(model_path) / "config.json"
    try:
        with path.open("rb") as f:
            data = f.read(MAX_MODEL_CONFIG_BYTES + 1)
        if len(data) > MAX_MODEL_CONFIG_BYTES:
            raise ValueError(f"larger than {MAX_MODEL_CONFIG_BYTES >> 20} MiB")
        config = json.loads(data.decode("utf-8"))
    except (OSError, ValueError, RecursionError) as err:  # JSON and UTF-8 errors are ValueErrors
        problem = getattr(err, "strerror", None) or first_line(err)[:200]
        raise ModelDirError(f"{path}: not a model config ({problem})") from None
    if not isinstance(config, dict):
        raise ModelDirError(f"{path}: not a model config (expected a JSON object)")
    return config
