"""A model directory the user names (`model.path`, `groupflow eval --model`): its config.json
read and checked to be a JSON object before anything loads the model, which would fail late
and at length."""

from __future__ import annotations

import json
from pathlib import Path

from groupflow.core.errors import UserError, first_line

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


# config.json keys that bound a model's positions, as vLLM reads them (the smallest counts).
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


def model_context(model_config: dict) -> int | None:
    """The positions a model takes, from its config.json; None where its config does not
    bound them, or stretches them (rope_scaling), which vLLM then works out itself."""
    if model_config.get("rope_scaling"):
        return None
    bounds = [v for k in CONTEXT_KEYS if type(v := model_config.get(k)) is int and v > 0]
    return min(bounds, default=None)


def check_context(max_model_len: int, context: int | None, model: str) -> None:
    """rollout.max_model_len within the model's positions, refused before any engine starts
    (vLLM would refuse it only then, at length)."""
    if context is not None and max_model_len > context:
        raise ModelDirError(
            f"rollout.max_model_len ({max_model_len}) is past the {context} positions of "
            f"{model}: set it to at most {context} (and rollout.sampling.max_tokens below it)"
        )


def check_tensor_parallel(tensor_parallel_size: int, model_config: dict, model: str) -> None:
    """rollout.tensor_parallel_size against the model's attention heads, as vLLM splits them:
    the query heads in equal shares, the key/value heads too or each replicated over an equal
    number of workers. vLLM refuses a misfit only once an engine starts, in a validation error
    of its own config that names neither setting."""
    tp = tensor_parallel_size
    text = model_config.get("text_config")
    source = text if isinstance(text, dict) and "num_attention_heads" in text else model_config
    heads = source.get("num_attention_heads")
    if type(heads) is not int or heads < 1 or tp == 1:
        return  # a model without the key: vLLM's own reading decides
    kv = source.get("num_key_value_heads")
    kv = kv if type(kv) is int and kv >= 1 else heads
    if heads % tp:
        problem = f"its {heads} attention heads"
    elif (tp % kv if tp >= kv else kv % tp) != 0:
        problem = f"its {kv} key/value heads (nor is it a multiple of them)"
    else:
        return
    fits = [
        n for n in range(1, heads + 1) if heads % n == 0 and (n % kv if n >= kv else kv % n) == 0
    ]
    raise ModelDirError(
        f"rollout.tensor_parallel_size: {tp} does not divide {problem} of {model}; one of "
        f"{fits} does"
    )
