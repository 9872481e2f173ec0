"""LoRA on a learner rank (Hu et al., arXiv 2106.09685): PEFT's adapters on the frozen model,
the adapter's parameters as a sync sends them, the KL reference as the model with its adapters
off, the adapter and the merged model as they are saved, and the check of a job's
`learner.lora` against its model before any actor starts.

The adapters go on after the model is loaded into ZeRO-3 shards and given its token head and
before deepspeed.initialize (learner/zero_models.py): PEFT creates them as plain tensors, and
DeepSpeed partitions them with the rest; the frozen base weights get no gradient and no
optimizer state (ZeRO-3 leaves parameters without requires_grad out of its optimizer).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from groupflow.config.base import ConfigError
from groupflow.config.learner import LoraConfig
from groupflow.core.adapters import meta_model, wire_name
from groupflow.learner.moe_blocks import config_has_experts, moe_blocks

_PEFT_PREFIX = "base_model.model."


def add_adapters(model: torch.nn.Module, lora: LoraConfig) -> torch.nn.Module:
    """`model` wrapped by PEFT with adapters on `lora.target_modules`, all else frozen."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    config = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        bias="none",
    )
    return get_peft_model(model, config)


def has_adapters(module: torch.nn.Module) -> bool:
    return hasattr(module, "peft_config")


def adapter_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The adapter's matrices by the names they travel under (groupflow/core/adapters.py)."""
    out = {}
    for name, param in module.named_parameters():
        wire = wire_name(name)
        if wire is not None and param.requires_grad:
            out[wire] = param
    return out


class AdaptersOff:
    """The policy with its adapters off, which is the base model exactly: the KL reference of
    a LoRA job, without a second copy of the weights. Called like the model: the PEFT model,
    or the DeepSpeed model wrapping it."""

    def __init__(self, model):
        self.model = model
        self.peft_model = getattr(model, "module", model)

    def __call__(self, *args, **kwargs):
        with self.peft_model.disable_adapter():
            return self.model(*args, **kwargs)


def gathered_adapter(module: torch.nn.Module, is_source: bool) -> dict[str, torch.Tensor]:
    """CPU copies of the adapter's matrices under PEFT's parameter names, on the source rank
    (empty on the others). Collective: every rank gathers. PEFT's own state-dict export reads
    ZeRO-3's empty placeholders, so the parameters are gathered first."""
    import deepspeed

    params = {n: p for n, p in module.named_parameters() if p.requires_grad}
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        if not is_source:
            return {}
        return {n: p.detach().to("cpu", copy=True) for n, p in params.items()}


def save_adapter(module: torch.nn.Module, is_source: bool, path: str) -> None:
    """The adapter in PEFT's format (adapter_config.json, adapter_model.safetensors), written
    by the source rank. Collective."""
    weights = gathered_adapter(module, is_source)
    if is_source:
        module.save_pretrained(path, state_dict=weights)


def merged_weights(
    module: torch.nn.Module, bucket: list[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """A gathered bucket of a PEFT model's parameters (whole layers, PEFT's names) as the base
    model's parameters with each adapter merged in: W + scaling * B A, in Hugging Face names."""
    tensors = dict(bucket)
    for name, tensor in bucket:
        if ".lora_" in name:
            continue
        hf_name = name.removeprefix(_PEFT_PREFIX)
        if name.endswith(".base_layer.weight"):
            layer = name.removesuffix(".base_layer.weight")
            hf_name = hf_name.replace(".base_layer.weight", ".weight")
            lora_layer = module.get_submodule(layer)
            adapter = lora_layer.active_adapters[0]
            a = tensors[f"{layer}.lora_A.{adapter}.weight"]
            b = tensors[f"{layer}.lora_B.{adapter}.weight"]
            scaling = lora_layer.scaling[adapter]
            tensor = tensor + (b.double() @ a.double() * scaling).to(tensor.dtype)
        elif name.endswith(".base_layer.bias"):
            hf_name = hf_name.replace(".base_layer.bias", ".bias")
        yield hf_name, tensor


# ----- the check before any actor starts -------------------------------------------------------


def check_target_modules(model_path: str, lora: LoraConfig) -> None:
    """ConfigError naming the entry of `learner.lora.target_modules` that matches nothing in
    the model at `model_path`, or matches what vLLM cannot serve an adapter on: anything but a
    linear layer of the transformer blocks (the embedding, the output head, a whole block), and
    in a mixture of experts anything inside its expert blocks (the router, the experts, shared
    experts: LoRA on a mixture of experts adapts attention and dense layers only, docs/moe.md).
    Builds the model on the meta device: no weights are read."""
    if lora.target_modules == "all-linear" and not config_has_experts(model_path):
        return
    model = meta_model(model_path)
    outside = {id(model.get_input_embeddings()), id(model.get_output_embeddings())}
    in_experts = {id(m): n for b in moe_blocks(model) for n, m in b.named_modules()}
    modules = dict(model.named_modules())
    adaptable = {n: m for n, m in modules.items() if _adaptable(m, outside)}
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in adaptable.items() if id(m) not in in_experts})
    if lora.target_modules == "all-linear":
        inside = next((n for n, m in adaptable.items() if id(m) in in_experts), None)
        if inside is not None:
            raise ConfigError(
                f"learner.lora.target_modules: all-linear puts an adapter on {inside}, inside a "
                f"mixture-of-experts block: LoRA on a mixture of experts adapts attention and "
                f"dense layers only; list them ({', '.join(linear)})"
            )
        return
    for entry in lora.target_modules:
        matched = {n: m for n, m in modules.items() if n == entry or n.endswith("." + entry)}
        where = f"learner.lora.target_modules: {entry!r}"
        if not matched:
            raise ConfigError(
                f"{where} matches no module of {model_path} (its adaptable layers: "
                f"{', '.join(linear)})"
            )
        inside = next((n for n, m in matched.items() if id(m) in in_experts), None)
        if inside is not None:
            raise ConfigError(
                f"{where} matches {inside}, in a mixture-of-experts block: LoRA on a mixture of "
                f"experts adapts attention and dense layers only ({', '.join(linear)})"
            )
        unfit = next((m for m in matched.values() if not _adaptable(m, outside)), None)
        if unfit is not None:
            raise ConfigError(
                f"{where} matches a {type(unfit).__name__}: vLLM serves adapters on the "
                f"transformer blocks' linear layers only ({', '.join(linear)})"
            )


def _adaptable(module: torch.nn.Module, outside: set[int]) -> bool:
    return isinstance(module, torch.nn.Linear) and id(module) not in outside
