import itertools
import random

import pytest

from groupflow.config import ConfigError
from groupflow.core.random_model import random_causal_lm
from groupflow.learner.zero_config import (
    MID_MODEL_PARAMETERS,
    WHOLE_MODEL_PARAMETERS,
    deepspeed_config,
    model_parameter_count,
    zero3_tuning,
)
from groupflow.run.job_config import build_config

B = 1_000_000_000


def ds_config(learner, dtype="bfloat16", num_parameters=500_000_000, world_size=2):
    return deepspeed_config(learner, dtype, num_parameters, world_size)


def test_defaults_decide_checkpointing_by_memory_and_offload_nothing():
    learner = build_config({}).learner
    assert learner.gradient_checkpointing == "auto"  # learner/memory_budget.py decides
    ds = ds_config(learner)
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3
    assert "offload_param" not in zero and "offload_optimizer" not in zero
    assert ds["bf16"] == {"enabled": True} and ds["fp16"] == {"enabled": False}
    assert ds["gradient_clipping"] == learner.optimizer.max_grad_norm


@pytest.mark.parametrize(("optimizer", "params"), [(True, False), (False, True), (True, True)])
def test_offload_options_reach_zero3(optimizer, params):
    learner = build_config(
        {}, [f"learner.offload_optimizer={optimizer}", f"learner.offload_params={params}"]
    ).learner
    zero = ds_config(learner, "float32")["zero_optimization"]
    assert ("offload_optimizer" in zero) == optimizer
    assert ("offload_param" in zero) == params
    for key in ("offload_optimizer", "offload_param"):
        assert zero.get(key, {"device": "cpu"}) == {"device": "cpu"}
    # the learner's torch AdamW must be allowed to step the offloaded state
    assert ds_config(learner, "float32")["zero_force_ds_cpu_optimizer"] is False


def test_a_wrong_option_is_named():
    with pytest.raises(ConfigError, match="learner.offload_params"):
        build_config({}, ["learner.offload_params=maybe"])


@pytest.mark.parametrize("num_parameters", [1_000, int(0.5 * B), int(7.6 * B), 70 * B])
def test_one_rank_keeps_every_parameter_whole(num_parameters):
    """At world size 1 partitioning saves nothing: no gathers, nothing to overlap."""
    knobs = zero3_tuning(num_parameters, 1, offload_params=False)
    assert knobs.param_persistence_threshold >= num_parameters
    assert knobs.max_live_parameters >= num_parameters
    assert not knobs.overlap_comm


@pytest.mark.parametrize("world_size", [2, 8, 64])
def test_the_table_by_model_size_on_many_ranks(world_size):
    small = zero3_tuning(int(1.5 * B), world_size, offload_params=False)
    assert small.param_persistence_threshold >= int(1.5 * B) and small.overlap_comm
    # Qwen2.5-7B: a 3584 x 18944 MLP matrix is partitioned, its norms (3584) are not
    mid = zero3_tuning(int(7.6 * B), world_size, offload_params=False)
    assert 3584 <= mid.param_persistence_threshold < 3584 * 18944
    assert mid.prefetch_bucket_size >= 3584 * 18944 and mid.overlap_comm
    large = zero3_tuning(70 * B, world_size, offload_params=False)
    assert large.param_persistence_threshold < mid.param_persistence_threshold
    assert large.max_live_parameters < mid.max_live_parameters


def test_the_table_is_monotone_in_model_size():
    """Up to WHOLE_MODEL_PARAMETERS a model is kept whole; past it, a larger model never keeps
    larger parameters whole, prefetches more or holds more live (fresh random sizes)."""
    rng = random.Random()
    sizes = [rng.randrange(1, 200 * B) for _ in range(50)]
    sizes += [WHOLE_MODEL_PARAMETERS, WHOLE_MODEL_PARAMETERS + 1, MID_MODEL_PARAMETERS + 1]
    partitioned = []
    for n in sorted(sizes):
        knobs = zero3_tuning(n, rng.randrange(2, 512), offload_params=False)
        assert (knobs.param_persistence_threshold >= n) == (n <= WHOLE_MODEL_PARAMETERS)
        if n > WHOLE_MODEL_PARAMETERS:
            partitioned.append(knobs)
    for smaller, larger in itertools.pairwise(partitioned):
        assert larger.param_persistence_threshold <= smaller.param_persistence_threshold
        assert larger.prefetch_bucket_size <= smaller.prefetch_bucket_size
        assert larger.max_live_parameters <= smaller.max_live_parameters


def test_offloaded_parameters_keep_deepspeeds_defaults():
    """Shards in host memory: keeping parameters whole on the accelerator would undo it."""
    for world_size in (1, 8):
        knobs = zero3_tuning(int(0.5 * B), world_size, offload_params=True)
        assert knobs.param_persistence_threshold == 100_000
        assert knobs.prefetch_bucket_size == 50_000_000


def test_the_config_overrides_each_knob_and_the_table_fills_the_rest():
    learner = build_config(
        {}, ["learner.zero3.param_persistence_threshold=12345", "learner.zero3.overlap_comm=false"]
    ).learner
    zero = ds_config(learner, num_parameters=int(7.6 * B), world_size=8)["zero_optimization"]
    table = zero3_tuning(int(7.6 * B), 8, offload_params=False)
    assert zero["stage3_param_persistence_threshold"] == 12345
    assert zero["overlap_comm"] is False
    assert zero["stage3_prefetch_bucket_size"] == table.prefetch_bucket_size
    assert zero["stage3_max_live_parameters"] == table.max_live_parameters


def test_deepspeed_reads_the_knobs():
    """The keys are DeepSpeed's own: its config model parses them to the table's values."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    learner = build_config({}).learner
    zero = ds_config(learner, num_parameters=int(7.6 * B), world_size=8)["zero_optimization"]
    parsed = DeepSpeedZeroConfig(**zero)
    table = zero3_tuning(int(7.6 * B), 8, offload_params=False)
    assert parsed.param_persistence_threshold == table.param_persistence_threshold
    assert parsed.prefetch_bucket_size == table.prefetch_bucket_size
    assert parsed.max_live_parameters == table.max_live_parameters
    assert parsed.overlap_comm == table.overlap_comm


def test_a_negative_knob_is_named():
    with pytest.raises(ConfigError, match="learner.zero3.max_live_parameters"):
        build_config({}, ["learner.zero3.max_live_parameters=-1"])


@pytest.mark.parametrize("tied", [True, False])
def test_the_parameter_count_comes_from_the_config_alone(tmp_path, tied):
    model = random_causal_lm(101, num_hidden_layers=3, tie_word_embeddings=tied)
    model.config.save_pretrained(tmp_path)  # no weights: the count must not need them
    assert model_parameter_count(str(tmp_path)) == sum(p.numel() for p in model.parameters())
    assert model_parameter_count(str(tmp_path)) > 101 * 16 * (1 if tied else 2)
