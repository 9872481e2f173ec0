"""LoRA adapters as they cross from the learner to the engines: the adapter's PEFT config as
vLLM reads it, the rank of an engine's LoRA slot, and the names the adapter's tensors travel
under (PEFT's saved names, the form vLLM parses), what a checkpoint's adapters must match, and an
adapter saved in PEFT's format as `groupflow eval` reads it. The learner side is
learner/lora.py, the engine side rollout/weight_receiver.py `load_adapter`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from groupflow.core.errors import UserError, first_line
from groupflow.core.hub_model import hub_model_id, local_model_path

if TYPE_CHECKING:
    from groupflow.config.learner import LoraConfig

# The ranks vLLM sizes its LoRA slots to (vllm/config/lora.py, 0.32).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

# The one adapter an engine serves: a sync replaces it in place under this id, between two
# engine steps, so running requests go on under the new version (rollout/engine.py).
ADAPTER_ID = 1
ADAPTER_NAME = "policy"

# A saved LoRA policy is the adapter in PEFT's format, and with trainer.save_merged the model
# with the adapter merged in, in this subdirectory.
MERGED_DIR = "merged"


def engine_max_rank(rank: int) -> int:
    """The smallest LoRA slot rank vLLM supports that holds an adapter of `rank`."""
    for slot in VLLM_LORA_RANKS:
        if rank <= slot:
            return slot
    raise ValueError(f"learner.lora.rank: {rank} is above {VLLM_LORA_RANKS[-1]}, vLLM's largest")


def serving_config(lora: LoraConfig) -> dict:
    """The adapter's config in PEFT's adapter_config.json keys, as vLLM's PEFTHelper reads it
    (it reads the scaling alpha / rank from here; which modules are adapted comes from the
    tensors' names)."""
    return {"r": lora.rank, "lora_alpha": lora.alpha, "target_modules": lora.target_modules}


def adapter_shape(lora: LoraConfig | None) -> dict | None:
    """What a checkpoint's adapters must match to resume (rank, alpha, targets); None without
    LoRA."""
    if lora is None:
        return None
    return {"rank": lora.rank, "alpha": lora.alpha, "target_modules": lora.target_modules}


_ADAPTER_NAME = re.compile(r"\.lora_([AB])\.[^.]+\.weight$")


def wire_name(parameter_name: str) -> str | None:
    """The name an adapter parameter travels under, PEFT's saved name without the adapter's
    own name ("...q_proj.lora_A.default.weight" -> "...q_proj.lora_A.weight"); None for a
    parameter that is not a LoRA matrix."""
    match = _ADAPTER_NAME.search(parameter_name)
    if match is None:
        return None
    return f"{parameter_name[: match.start()]}.lora_{match.group(1)}.weight"


# ----- a saved adapter (`groupflow eval --model`) ---------------------------------------------

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# adapter_config.json is a few hundred bytes; more than this is not one (a file of gigabytes,
# sparse or not, is refused by its size, never read whole).
MAX_ADAPTER_CONFIG_BYTES = 1 << 20
# lora_alpha's bound, learner.lora.alpha's (groupflow/config/learner.py): twice the largest rank.
MAX_LORA_ALPHA = 1024


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


@dataclass
class SavedAdapter:
    """A LoRA adapter in PEFT's format, as a LoRA job saves its policy."""

    path: Path
    base: str  # the model directory it was trained on
    config: dict  # adapter_config.json

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The adapter's matrices, each checked before an engine sees it: a 2-D floating
        matrix, every value finite, fitting a linear layer of the base model at the config's
        rank `r`, each lora_A with its lora_B. An adapter trained on another model, or one
        edited or corrupted, is refused naming the file and its first culprit."""
        from safetensors.torch import load_file

        file = self.path / ADAPTER_WEIGHTS
        try:
            tensors = load_file(file)
        except Exception as err:  # safetensors' own error type is no OSError or ValueError
            raise AdapterError(f"{file}: unreadable ({first_line(err)})") from None
        if not tensors:
            raise AdapterError(f"{file}: holds no tensors")
        modules = dict(meta_model(self.base).named_modules())
        ranks = self.ranks
        halves: dict[str, dict[str, tuple[str, int]]] = {}  # layer -> A/B -> (name, rank)
        for name, tensor in tensors.items():
            match = _SAVED_NAME.match(name)
            if match is None:
                raise AdapterError(
                    f"{file}: {name}: not a LoRA matrix (vLLM serves lora_A and lora_B of "
                    "linear layers only)"
                )
            layer, half = match.groups()
            if tensor.dim() != 2 or not tensor.is_floating_point():
                raise AdapterError(
                    f"{file}: {name}: a {tensor.dim()}-D {tensor.dtype} tensor, not a matrix "
                    "of floats"
                )
            module = modules.get(layer)
            if not isinstance(module, torch.nn.Linear):
                raise AdapterError(f"{file}: {name}: no linear layer of {self.base} by that name")
            want = (
                (tensor.shape[0], module.in_features)
                if half == "A"
                else (module.out_features, tensor.shape[1])
            )
            if tuple(tensor.shape) != want:
                raise AdapterError(
                    f"{file}: {name}: shape {tuple(tensor.shape)} does not fit {self.base}'s "
                    f"layer ({module.in_features} in, {module.out_features} out): an adapter "
                    "of another model"
                )
            its_rank = tensor.shape[0] if half == "A" else tensor.shape[1]
            if its_rank not in ranks:
                raise AdapterError(
                    f"{file}: {name}: rank {its_rank}, but {ADAPTER_CONFIG} says r "
                    f"{self.config['r']}" + (f" (or {sorted(ranks)})" if len(ranks) > 1 else "")
                )
            if not bool(torch.isfinite(tensor).all()):
                raise AdapterError(f"{file}: {name}: holds NaN or infinite values")
            halves.setdefault(layer, {})[half] = (name, its_rank)
        for found in halves.values():
            if len(found) == 1:
                ((lone, (name, _)),) = found.items()
                raise AdapterError(f"{file}: {name} has no lora_{'B' if lone == 'A' else 'A'}")
            (a_name, a_rank), (_, b_rank) = found["A"], found["B"]
            if a_rank != b_rank:
                raise AdapterError(f"{file}: {a_name}: rank {a_rank}, but its lora_B's is {b_rank}")
        return list(tensors.items())

    @property
    def ranks(self) -> set[int]:
        """The ranks the config allows its matrices: r, and PEFT's per-module rank_pattern."""
        return {self.config["r"], *(self.config.get("rank_pattern") or {}).values()}


# "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight" -> the module, A or B
_SAVED_NAME = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])\.weight$")


def meta_model(model_path: str | Path) -> torch.nn.Module:
    """The model at `model_path` built on the meta device from its config: its modules and
    their shapes, no weights read."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights():
        try:
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
        except Exception as err:  # transformers raises whatever its parsers hit
            raise AdapterError(
                f"{Path(model_path) / 'config.json'}: not a model config transformers can "
                f"build ({type(err).__name__}: {first_line(err, 200)})"
            ) from None


def _is_rank(value: object) -> bool:
    return type(value) is int and 0 < value <= VLLM_LORA_RANKS[-1]


def _is_alpha(value: object) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and 0 < value <= MAX_LORA_ALPHA


class AdapterError(UserError):
    """A saved adapter that cannot be served."""


def read_adapter_dir(path: str | Path) -> SavedAdapter:
    """The adapter saved in `path`, its base model checked to be a model directory with the
    shapes the adapter was trained for; AdapterError naming the file and key otherwise."""
    path = Path(path)
    config_file = path / ADAPTER_CONFIG
    try:
        with config_file.open("rb") as f:  # never more than the bound, whatever the file's size
            text = f.read(MAX_ADAPTER_CONFIG_BYTES + 1)
        if len(text) > MAX_ADAPTER_CONFIG_BYTES:
            raise ValueError(f"larger than {MAX_ADAPTER_CONFIG_BYTES} bytes")
        config = json.loads(text)
    except (OSError, ValueError, RecursionError) as err:
        raise AdapterError(f"{config_file}: not an adapter config ({first_line(err)})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise AdapterError(f"{config_file}: not a LoRA adapter (peft_type LORA)")
    rank = config.get("r")
    if not _is_rank(rank):
        raise AdapterError(f"{config_file}: r: {rank!r} is not a rank vLLM serves (1 to 512)")
    alpha = config.get("lora_alpha")
    if not _is_alpha(alpha):
        raise AdapterError(
            f"{config_file}: lora_alpha: {alpha!r} is not a number in (0, {MAX_LORA_ALPHA}]"
        )
    for key, fits, what in (
        ("rank_pattern", _is_rank, "a rank vLLM serves"),
        ("alpha_pattern", _is_alpha, f"a number in (0, {MAX_LORA_ALPHA}]"),
    ):
        pattern = config.get(key) or {}
        if not isinstance(pattern, dict):
            raise AdapterError(f"{config_file}: {key}: {pattern!r} is not a mapping")
        for module, value in pattern.items():
            if not fits(value):
                raise AdapterError(f"{config_file}: {key}: {module}: {value!r} is not {what}")
    base = config.get("base_model_name_or_path")
    if isinstance(base, str) and hub_model_id(base) is not None:
        # a base named by its hub id, as PEFT saves one trained from the hub
        base = local_model_path(base, f"{config_file}: base_model_name_or_path")
    if not isinstance(base, str) or not (Path(base) / "config.json").is_file():
        raise AdapterError(
            f"{config_file}: base_model_name_or_path: {base!r} is not a model directory here"
        )
    return SavedAdapter(path, base, config)
