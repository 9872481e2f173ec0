import pytest

from groupflow.config import ConfigError, build_config
from groupflow.learner.zero_config import deepspeed_config


def test_defaults_checkpoint_layers_and_offload_nothing():
    learner = build_config({}).learner
    assert learner.gradient_checkpointing
    ds = deepspeed_config(learner, "bfloat16")
    assert ds["zero_optimization"] == {"stage": 3}
    assert ds["bf16"] == {"enabled": True} and ds["fp16"] == {"enabled": False}
    assert ds["gradient_clipping"] == learner.optimizer.max_grad_norm


@pytest.mark.parametrize(("optimizer", "params"), [(True, False), (False, True), (True, True)])
def test_offload_options_reach_zero3(optimizer, params):
    learner = build_config(
        {}, [f"learner.offload_optimizer={optimizer}", f"learner.offload_params={params}"]
    ).learner
    zero = deepspeed_config(learner, "float32")["zero_optimization"]
    assert ("offload_optimizer" in zero) == optimizer
    assert ("offload_param" in zero) == params
    for key in ("offload_optimizer", "offload_param"):
        assert zero.get(key, {"device": "cpu"}) == {"device": "cpu"}
    # the learner's torch AdamW must be allowed to step the offloaded state
    assert deepspeed_config(learner, "float32")["zero_force_ds_cpu_optimizer"] is False


def test_a_wrong_option_is_named():
    with pytest.raises(ConfigError, match="learner.offload_params"):
        build_config({}, ["learner.offload_params=maybe"])
