"""LoRA on the learner (learner/lora.py, groupflow/core/adapters.py), without DeepSpeed: on the tiny
float64 transformer of test_learner_step, only the adapters move, micro-batches and ranks leave
their update unchanged, the adapters-off reference is the base model, a merged export is
PEFT's own merge; and the settings a job is refused for."""

from __future__ import annotations

import copy
import json
import math
import tracemalloc
from pathlib import Path

import pytest
import torch

from groupflow.config import ConfigError, LoraConfig
from groupflow.core.adapters import AdapterError, engine_max_rank, read_adapter_dir, wire_name
from groupflow.core.random_model import random_causal_lm
from groupflow.learner.lora import (
    AdaptersOff,
    adapter_parameters,
    add_adapters,
    check_target_modules,
    merged_weights,
)
from groupflow.learner.token_head import response_positions, response_token_stats
from groupflow.run.job_config import build_config
from tests.unit.test_learner_step import (
    F64,
    algorithm,
    layout,
    one_thread,  # noqa: F401 (autouse fixture)
    run_step,
    sample_step,
    tiny_model,
)


def lora_model(gen: torch.Generator, target_modules="all-linear") -> torch.nn.Module:
    """tiny_model with rank-4 adapters whose B is random: at PEFT's B = 0 the A matrices would
    get no gradient at the first step, and a test would not see them."""
    model = add_adapters(
        tiny_model(gen), LoraConfig(rank=4, alpha=8, target_modules=target_modules)
    ).to(F64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=F64))
    return model


def test_only_the_adapters_move_and_every_one_does(gen):
    model = lora_model(gen)
    algo = algorithm("grpo")
    seqs = sample_step(model, gen, algo)
    delta, _ = run_step(model, algo, layout(seqs, gen, 1, many_micro_batches=True))
    names = [n for n, _ in model.named_parameters()]
    moved = {n for n, d in zip(names, delta, strict=True) if d.abs().max() > 0}
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_" in n for n in adapters)
    assert moved == adapters


@pytest.mark.parametrize("preset", ["grpo", "stapo", "lopti", "dfpo"])
def test_micro_batches_and_ranks_leave_the_adapters_update_unchanged(gen, preset):
    model = lora_model(gen)
    algo = algorithm(preset)
    seqs = sample_step(model, gen, algo)
    base, _ = run_step(model, algo, layout(seqs, gen, 1, many_micro_batches=False))
    scale = max(d.abs().max().item() for d in base)
    assert scale > 0
    for world_size, many in [(1, True), (2, False), (2, True)]:
        delta, _ = run_step(model, algo, layout(seqs, gen, world_size, many_micro_batches=many))
        for got, want in zip(delta, base, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7 * scale)


def _logp(model, ids: torch.Tensor) -> torch.Tensor:
    positions = response_positions(ids, [ids.shape[1]], [1])
    return response_token_stats(model, ids, torch.ones_like(ids), positions, 1.0).logp


def test_the_reference_with_adapters_off_is_the_base_model_exactly(gen):
    base = tiny_model(gen)
    ids = torch.randint(0, 48, (1, 12), generator=gen)
    want = _logp(base, ids)
    model = add_adapters(copy.deepcopy(base), LoraConfig(rank=4, alpha=8)).to(F64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=F64))
    with torch.no_grad():
        assert not torch.equal(_logp(model, ids), want), "the adapters must change the model"
        assert torch.equal(_logp(AdaptersOff(model), ids), want)
        assert not torch.equal(_logp(model, ids), want), "and be back on afterwards"


def test_a_merged_export_is_peft_merge(gen):
    model = lora_model(gen, target_modules=["q_proj", "down_proj"])
    every = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    merged = dict(merged_weights(model, every))
    want = {k: v for k, v in copy.deepcopy(model).merge_and_unload().state_dict().items()}
    assert merged.keys() <= want.keys()
    assert want.keys() - merged.keys() <= {"lm_head.weight"}  # tied to the embedding
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, want[name], rtol=0, atol=1e-12, msg=name)
    assert not torch.equal(
        merged["model.layers.0.self_attn.q_proj.weight"],
        dict(every)["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"],
    )


def test_a_sync_carries_the_adapters_under_peft_names(gen):
    model = lora_model(gen, target_modules=["v_proj"])
    names = sorted(adapter_parameters(model))
    assert names and all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in names)
    assert all(".default." not in n and "v_proj" in n for n in names)
    assert len(names) == 2 * 2  # A and B of the two layers' v_proj


def test_wire_names_and_slot_ranks():
    name = "base_model.model.model.layers.3.mlp.up_proj.lora_B.default.weight"
    assert wire_name(name) == "base_model.model.model.layers.3.mlp.up_proj.lora_B.weight"
    assert wire_name("base_model.model.model.layers.3.mlp.up_proj.base_layer.weight") is None
    assert [engine_max_rank(r) for r in (1, 2, 8, 9, 300, 321, 512)] == [1, 8, 8, 16, 320, 512, 512]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2")
    random_causal_lm(
        64,
        seed=0,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    ).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("modules", ["all-linear", ["q_proj", "v_proj"], ["mlp.down_proj"]])
def test_target_modules_that_vllm_serves_pass(model_dir, modules):
    check_target_modules(model_dir, LoraConfig(target_modules=modules))


@pytest.mark.parametrize(
    "modules, said",
    [
        (["q_proj", "qproj"], "'qproj' matches no module"),
        (["lm_head"], "'lm_head' matches a Linear: vLLM serves adapters on the transformer"),
        (["embed_tokens"], "'embed_tokens' matches a Embedding"),
        (["mlp"], "'mlp' matches a Qwen2MLP"),
    ],
)
def test_target_modules_vllm_cannot_serve_are_refused_naming_the_entry(model_dir, modules, said):
    with pytest.raises(ConfigError, match="learner.lora.target_modules: ") as err:
        check_target_modules(model_dir, LoraConfig(target_modules=modules))
    assert said in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "lora, key",
    [
        ({"rank": 0}, "learner.lora.rank"),
        ({"rank": 513}, "learner.lora.rank"),
        ({"alpha": 0}, "learner.lora.alpha"),
        ({"dropout": 1.0}, "learner.lora.dropout"),
        ({"target_modules": []}, "learner.lora.target_modules"),
        ({"target_modules": ["q_proj", " "]}, "learner.lora.target_modules"),
        ({"target_modules": "all"}, "learner.lora.target_modules"),
    ],
)
def test_bad_lora_settings_name_the_key(lora, key):
    with pytest.raises(ConfigError, match=key):
        build_config({"learner": {"lora": lora}})


def _saved_adapter(model_dir: str, out, **config_changes) -> None:
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    peft_model = get_peft_model(model, PeftLoraConfig(r=4, target_modules=["q_proj"]))
    peft_model.save_pretrained(out)
    config_file = out / "adapter_config.json"
    config = json.loads(config_file.read_text()) | config_changes
    config_file.write_text(json.dumps(config))


def test_a_saved_adapter_fits_its_base(model_dir, tmp_path):
    _saved_adapter(model_dir, tmp_path)
    adapter = read_adapter_dir(tmp_path)
    assert adapter.base == model_dir and adapter.config["r"] == 4
    names = [name for name, _ in adapter.tensors()]
    assert names and all(".q_proj.lora_" in n for n in names)


@pytest.mark.parametrize(
    "changes, said",
    [
        ({"base_model_name_or_path": "/nonexistent"}, "base_model_name_or_path: '/nonexistent'"),
        ({"base_model_name_or_path": None}, "base_model_name_or_path: None"),
        ({"peft_type": "PREFIX_TUNING"}, "not a LoRA adapter"),
        ({"r": 0}, "r: 0 is not a rank vLLM serves"),
        ({"r": "8"}, "r: '8' is not a rank"),
    ],
)
def test_a_bad_adapter_config_is_one_line_naming_the_key(model_dir, tmp_path, changes, said):
    _saved_adapter(model_dir, tmp_path, **changes)
    with pytest.raises(AdapterError, match="adapter_config.json: ") as err:
        read_adapter_dir(tmp_path)
    assert said in str(err.value)


@pytest.mark.parametrize(
    "tensors, said",
    [
        ({"model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 17)}, "shape (4, 17)"),
        ({"model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(5, 4)}, "shape (5, 4)"),
        ({"model.layers.7.self_attn.q_proj.lora_A.weight": torch.zeros(4, 16)}, "no linear"),
        ({"model.norm.lora_A.weight": torch.zeros(4, 16)}, "no linear layer"),
        ({"lm_head.weight": torch.zeros(64, 16)}, "not a LoRA matrix"),
    ],
)
def test_adapter_tensors_that_do_not_fit_the_base_are_named(model_dir, tmp_path, tensors, said):
    from safetensors.torch import save_file

    _saved_adapter(model_dir, tmp_path)
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match=f"adapter_model.safetensors: {next(iter(tensors))}"):
        read_adapter_dir(tmp_path).tensors()
    with pytest.raises(AdapterError) as err:
        read_adapter_dir(tmp_path).tensors()
    assert said in str(err.value)


def test_an_unreadable_adapter_file_is_one_line(model_dir, tmp_path):
    _saved_adapter(model_dir, tmp_path)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(AdapterError, match="adapter_model.safetensors: unreadable"):
        read_adapter_dir(tmp_path).tensors()


Q = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize(
    "tensors, said",
    [
        (
            {
                f"{Q}.lora_A.weight": torch.full((4, 16), math.nan),
                f"{Q}.lora_B.weight": torch.zeros(16, 4),
            },
            f"{Q}.lora_A.weight: holds NaN or infinite values",
        ),
        (
            {
                f"{Q}.lora_A.weight": torch.zeros(4, 16),
                f"{Q}.lora_B.weight": torch.full((16, 4), math.inf),
            },
            f"{Q}.lora_B.weight: holds NaN or infinite values",
        ),
        (
            {f"{Q}.lora_A.weight": torch.zeros(4, 16), f"{Q}.lora_B.weight": torch.zeros(16, 8)},
            f"{Q}.lora_B.weight: rank 8, but adapter_config.json says r 4",
        ),
        (
            {f"{Q}.lora_A.weight": torch.zeros(8, 16), f"{Q}.lora_B.weight": torch.zeros(16, 8)},
            f"{Q}.lora_A.weight: rank 8, but adapter_config.json says r 4",
        ),
        ({f"{Q}.lora_A.weight": torch.zeros(4, 16)}, f"{Q}.lora_A.weight has no lora_B"),
        ({f"{Q}.lora_B.weight": torch.zeros(16, 4)}, f"{Q}.lora_B.weight has no lora_A"),
        ({f"{Q}.lora_A.weight": torch.tensor(1.0)}, f"{Q}.lora_A.weight: a 0-D torch.float32"),
        ({f"{Q}.lora_A.weight": torch.zeros(16)}, f"{Q}.lora_A.weight: a 1-D torch.float32"),
        ({f"{Q}.lora_A.weight": torch.zeros(4, 16, dtype=torch.int64)}, "torch.int64 tensor"),
        ({}, "holds no tensors"),
    ],
)
def test_adapter_tensors_are_checked_before_an_engine_sees_them(model_dir, tmp_path, tensors, said):
    """Served as they were, these gave NaN answers, or a traceback from inside vLLM after the
    engine started (issue 39)."""
    from safetensors.torch import save_file

    _saved_adapter(model_dir, tmp_path)
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    with pytest.raises(AdapterError) as err:
        read_adapter_dir(tmp_path).tensors()
    message = str(err.value)
    assert message.startswith(f"{tmp_path / 'adapter_model.safetensors'}: ") and said in message
    assert "\n" not in message


def test_a_rank_pattern_allows_its_ranks(model_dir, tmp_path):
    from safetensors.torch import save_file

    _saved_adapter(model_dir, tmp_path, rank_pattern={"q_proj": 8})
    save_file(
        {f"{Q}.lora_A.weight": torch.zeros(8, 16), f"{Q}.lora_B.weight": torch.zeros(16, 8)},
        tmp_path / "adapter_model.safetensors",
    )
    adapter = read_adapter_dir(tmp_path)
    assert len(adapter.tensors()) == 2 and max(adapter.ranks) == 8
    # A and B at ranks the config allows, but not the same one
    save_file(
        {f"{Q}.lora_A.weight": torch.zeros(4, 16), f"{Q}.lora_B.weight": torch.zeros(16, 8)},
        tmp_path / "adapter_model.safetensors",
    )
    with pytest.raises(AdapterError, match=f"{Q}.lora_A.weight: rank 4, but its lora_B's is 8"):
        adapter.tensors()


@pytest.mark.parametrize(
    "changes, said",
    [
        ({"lora_alpha": -32}, "lora_alpha: -32 is not a number in (0, 1024]"),
        ({"lora_alpha": math.nan}, "lora_alpha: nan is not a number"),
        ({"lora_alpha": "16"}, "lora_alpha: '16' is not a number"),
        ({"lora_alpha": True}, "lora_alpha: True is not a number"),
        ({"lora_alpha": 1e300}, "lora_alpha: 1e+300 is not a number"),
        ({"lora_alpha": None}, "lora_alpha: None is not a number"),
        ({"r": True}, "r: True is not a rank"),
        ({"rank_pattern": {"q_proj": 0}}, "rank_pattern: q_proj: 0 is not a rank vLLM serves"),
        ({"rank_pattern": [8]}, "rank_pattern: [8] is not a mapping"),
        ({"alpha_pattern": {"q_proj": -1.0}}, "alpha_pattern: q_proj: -1.0 is not a number"),
    ],
)
def test_a_hostile_adapter_config_is_one_line_naming_the_key(model_dir, tmp_path, changes, said):
    _saved_adapter(model_dir, tmp_path, **changes)
    with pytest.raises(AdapterError, match="adapter_config.json: ") as err:
        read_adapter_dir(tmp_path)
    assert said in str(err.value)


def test_a_huge_adapter_config_is_refused_unread(model_dir, tmp_path):
    """A 4 GiB sparse adapter_config.json gave a MemoryError: it was read whole, then cut."""
    _saved_adapter(model_dir, tmp_path)
    with open(tmp_path / "adapter_config.json", "r+b") as f:
        f.truncate(4 << 30)  # sparse: no disk taken
    tracemalloc.start()
    try:
        with pytest.raises(
            AdapterError,
            match=r"adapter_config.json: not an adapter config \(larger than 1048576 bytes\)",
        ):
            read_adapter_dir(tmp_path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20


def test_a_base_config_transformers_cannot_build_is_one_line(model_dir, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    config = json.loads((Path(model_dir) / "config.json").read_text())
    (base / "config.json").write_text(json.dumps(config | {"num_attention_heads": 0}))
    adapter = tmp_path / "adapter"
    _saved_adapter(model_dir, adapter, base_model_name_or_path=str(base))
    with pytest.raises(AdapterError) as err:
        read_adapter_dir(adapter).tensors()
    message = str(err.value)
    assert message.startswith(f"{base / 'config.json'}: not a model config transformers can build")
    assert "\n" not in message
