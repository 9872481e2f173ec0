"""A real DeepSpeed ZeRO-3 checkpoint (world size 1, gloo, CPU accelerator) passes the ranks'
weights-only check and loads, STAPO's running threshold with it; the same files with a code-running pickle in place of the
optimizer shard are refused before DeepSpeed reads them (learner/checkpoint.py)."""

from __future__ import annotations

import os

import pytest

from tests.integration.test_token_head_zero3 import _init_rank, _model

pytestmark = pytest.mark.integration


class _Touch:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def save_load_and_tamper(path: str) -> tuple[bool, str]:
    """Runs in a spawned rank process: a clean save and load, then a tampered load."""
    _init_rank()
    from pathlib import Path

    import deepspeed
    import torch
    from transformers.integrations import HfDeepSpeedConfig

    from groupflow.config import LearnerConfig, Zero3Config
    from groupflow.core.errors import CheckpointError
    from groupflow.learner.auto_threshold import RunningProbabilityThreshold, probability_histogram
    from groupflow.learner.checkpoint import TAG, load_rank_checkpoint, save_rank_checkpoint
    from groupflow.learner.zero_config import deepspeed_config

    # Partitioned, as a model too large to keep whole is (docs/zero3_tuning.md).
    cfg = LearnerConfig(zero3=Zero3Config(param_persistence_threshold=0))
    model = _model(0, tied=False)
    nparams = sum(p.numel() for p in model.parameters())
    ds_config = deepspeed_config(cfg, "float32", nparams, world_size=1)
    hf_ds_config = HfDeepSpeedConfig(ds_config)  # noqa: F841 (kept alive for the engine)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01), config=ds_config
    )
    threshold, restored = (RunningProbabilityThreshold(0.05, 0.8) for _ in range(2))
    threshold.update(probability_histogram(torch.rand(1000, dtype=torch.float64) ** 8))
    save_rank_checkpoint(engine, path, 0, threshold)
    assert load_rank_checkpoint(engine, path, 0, restored) is None
    assert torch.equal(restored.counts, threshold.counts) and threshold.counts.sum() == 1000
    optim = next(Path(path, TAG).glob("*optim_states.pt"))
    state = torch.load(optim, weights_only=False)
    state["optimizer_state_dict"]["loss_scaler"] = _Touch(f"{path}/MARKER")
    torch.save(state, optim)
    try:
        load_rank_checkpoint(engine, path, 0)
    except CheckpointError as err:
        return Path(path, "MARKER").exists(), str(err)
    return Path(path, "MARKER").exists(), ""


def test_a_real_zero3_checkpoint_passes_and_a_tampered_one_is_refused(rank_process, tmp_path):
    ran, refusal = rank_process.submit(save_load_and_tamper, str(tmp_path)).result(timeout=300)
    assert not ran
    assert "optim_states.pt" in refusal and "system" in refusal and "\n" not in refusal
