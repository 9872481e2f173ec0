"""LoRA adapters as they cross from the learner to the engines: the adapter's PEFT config as
vLLM reads it, the rank of an engine's LoRA slot, and the names the adapter's tensors travel
under (PEFT's saved names, the form vLLM parses). The learner side is learner/lora.py, the
engine side rollout/weight_receiver.py `load_adapter`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from groupflow.config import LoraConfig

# The ranks vLLM sizes its LoRA slots to (vllm/config/lora.py, 0.32).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

# The one adapter an engine serves: a sync replaces it in place under this id, between two
# engine steps, so running requests go on under the new version (rollout/engine.py).
ADAPTER_ID = 1
ADAPTER_NAME = "policy"


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


_ADAPTER_NAME = re.compile(r"\.lora_([AB])\.[^.]+\.weight$")


def wire_name(parameter_name: str) -> str | None:
    """The name an adapter parameter travels under, PEFT's saved name without the adapter's
    own name ("...q_proj.lora_A.default.weight" -> "...q_proj.lora_A.weight"); None for a
    parameter that is not a LoRA matrix."""
    match = _ADAPTER_NAME.search(parameter_name)
    if match is None:
        return None
    return f"{parameter_name[: match.start()]}.lora_{match.group(1)}.weight"
