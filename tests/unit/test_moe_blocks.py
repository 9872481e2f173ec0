"""Mixture-of-experts blocks on the learner (learner/moe_blocks.py): found in any model that
holds its experts in an `experts` module, made ZeRO-3 leaf modules by learner.moe.leaf_modules,
and LoRA refused inside them in one line (learner/lora.py). How a leaf block is gathered under
real ZeRO-3 is tests/integration/test_token_head_zero3.py's."""

from __future__ import annotations

import pytest
from deepspeed.utils import z3_leaf_module

from groupflow.config.base import ConfigError
from groupflow.config.learner import LearnerConfig, LoraConfig, MoeConfig
from groupflow.core.random_model import random_causal_lm
from groupflow.learner.lora import check_target_modules
from groupflow.learner.model_setup import prepare_model
from groupflow.learner.moe_blocks import make_leaf_modules, moe_blocks

# A mixture of experts small enough for a second's forward: 4 experts, 2 per token, 2 layers
# (tests/integration/test_token_head_zero3.py uses it too).
TINY_MOE = dict(
    hidden_size=32,
    moe_intermediate_size=16,
    intermediate_size=64,
    num_experts=4,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
)


def _moe(**changes):
    return random_causal_lm(40, architecture="qwen3_moe", seed=0, **(TINY_MOE | changes))


def _dense():
    return random_causal_lm(40, seed=0, hidden_size=16, intermediate_size=32, num_hidden_layers=2)


def test_the_blocks_are_the_modules_that_hold_the_experts():
    model = _moe()
    blocks = moe_blocks(model)
    assert [type(b).__name__ for b in blocks] == ["Qwen3MoeSparseMoeBlock"] * 2
    assert blocks == [layer.mlp for layer in model.model.layers]
    assert moe_blocks(_dense()) == []
    # a layer in mlp_only_layers is dense: no block
    assert len(moe_blocks(_moe(mlp_only_layers=[0]))) == 1


@pytest.mark.parametrize("leaf", [True, False])
def test_learner_moe_leaf_modules_flags_each_block_before_deepspeed_hooks_it(leaf):
    model = _moe()
    prepare_model(model, LearnerConfig(moe=MoeConfig(leaf_modules=leaf)), trainable=False)
    flagged = [m for m in model.modules() if z3_leaf_module(m)]
    assert flagged == (moe_blocks(model) if leaf else [])


def test_a_dense_model_has_no_leaf_module():
    model = _dense()
    assert make_leaf_modules(model) == 0
    assert not any(z3_leaf_module(m) for m in model.modules())
    assert LearnerConfig().moe.leaf_modules, "on by default"


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    _moe().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def shared_experts_dir(tmp_path_factory):
    """A Qwen2-MoE: its blocks hold a shared expert of plain linear layers."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    path = tmp_path_factory.mktemp("qwen2_moe")
    config = Qwen2MoeConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=8,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    Qwen2MoeForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("modules", ["all-linear", ["q_proj", "o_proj"]])
def test_lora_on_a_mixture_of_experts_adapts_its_attention(moe_dir, modules):
    check_target_modules(moe_dir, LoraConfig(target_modules=modules))


@pytest.mark.parametrize(
    "modules, said",
    [
        (["q_proj", "experts"], "'experts' matches model.layers.0.mlp.experts, in a mixture"),
        (["gate"], "'gate' matches model.layers.0.mlp.gate, in a mixture-of-experts block"),
        (["mlp"], "'mlp' matches model.layers.0.mlp, in a mixture-of-experts block"),
    ],
)
def test_lora_inside_the_expert_blocks_is_refused_in_one_line(moe_dir, modules, said):
    with pytest.raises(ConfigError) as err:
        check_target_modules(moe_dir, LoraConfig(target_modules=modules))
    line = str(err.value)
    assert line.startswith("learner.lora.target_modules: ") and "\n" not in line
    assert said in line and line.endswith(
        "LoRA on a mixture of experts adapts attention and dense layers only "
        "(k_proj, o_proj, q_proj, v_proj)"
    ), line


def test_all_linear_is_refused_where_it_would_reach_into_a_block(shared_experts_dir):
    with pytest.raises(ConfigError) as err:
        check_target_modules(shared_experts_dir, LoraConfig(target_modules="all-linear"))
    line = str(err.value)
    assert "all-linear puts an adapter on model.layers.0.mlp.shared_expert." in line, line
    assert "\n" not in line
    check_target_modules(shared_experts_dir, LoraConfig(target_modules=["q_proj", "v_proj"]))
