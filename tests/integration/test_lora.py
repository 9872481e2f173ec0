"""LoRA on the real stack (issue 28): 2 DeepSpeed ZeRO-3 ranks training adapters, one vLLM
engine serving them from memory, on the shared local Ray cluster. (The quickstart job trained
with LoRA, learning and saving its adapter, is tests/integration/test_scale.py's job.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file

from groupflow.actors.generator import start_generator_pool
from groupflow.actors.learner import LearnerGroup
from groupflow.actors.transport_collective import CollectiveTransport
from groupflow.actors.transport_object_store import ObjectStoreTransport
from groupflow.config import SamplingConfig
from groupflow.core.adapters import MERGED_DIR, adapter_shape
from groupflow.core.errors import CheckpointError
from groupflow.loop.checkpoint_adapters import check_adapter_record
from groupflow.reward_workers.tasks import make_task
from groupflow.run.job_config import small_model_config
from tests.integration.test_stack import _sample_sequences, _sync, _train

pytestmark = pytest.mark.integration

LORA = [
    "learner.lora.rank=8",
    "learner.lora.alpha=16",
    "learner.optimizer.lr=2e-2",
    "trainer.save_merged=true",
    # the reference is the model with its adapters off: exercised in every step
    "algorithm.kl.coef=0.01",
]


@pytest.fixture(scope="module")
def lora_stack(ray_cluster, quickstart_model):
    cfg = small_model_config({}, ["rollout.num_engines=1", *LORA])
    pool = start_generator_pool(cfg, quickstart_model)
    learner = LearnerGroup(cfg, quickstart_model)
    yield cfg, pool.engines, learner
    learner.shutdown()
    pool.shutdown()


def _saved(learner, path: Path) -> dict[str, torch.Tensor]:
    learner.save_pretrained(str(path))
    return load_file(path / "adapter_model.safetensors")


def _greedy_hf(model_dir: Path, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompt_ids:
            gen = model.generate(
                torch.tensor([ids]),
                max_new_tokens=max_tokens,
                do_sample=False,
                top_k=None,
                top_p=None,
                pad_token_id=model.config.eos_token_id,
            )
            tokens = gen[0, len(ids) :].tolist()
            eos = model.config.eos_token_id
            out.append(tokens[: tokens.index(eos) + 1] if eos in tokens else tokens)
    return out


def test_a_sync_sends_the_adapter_only_and_the_engine_serves_the_merged_model(lora_stack, tmp_path):
    cfg, engines, learner = lora_stack
    before = _saved(learner, tmp_path / "before")
    results = _train(learner, _sample_sequences(engines, n_prompts=8, group_size=4))
    assert all(r.optimizer_updates == 1 for r in results)
    after = _saved(learner, tmp_path / "after")
    assert before.keys() == after.keys() and all(".lora_" in k for k in after)
    assert any(not torch.equal(before[k], after[k]) for k in after), "the step moved no adapter"

    transport = ObjectStoreTransport(learner, engines)
    # What a sync moves is the adapter, counted by the transport: its tensors' bytes.
    adapter_bytes = sum(t.numel() * t.element_size() for t in after.values())
    assert transport.bytes_per_sync == adapter_bytes
    assert {name for bucket in transport.buckets for name, _, _ in bucket} == set(after)
    _sync(transport, version=1)  # verified: the engine's checksums of what it loaded

    merged_dir = tmp_path / "after" / MERGED_DIR
    assert (merged_dir / "config.json").is_file()
    task = make_task("arithmetic")
    prompts = task.eval_prompts(12)
    answers = ray.get(
        engines[0].complete.remote(prompts, 1, SamplingConfig(max_tokens=12), greedy=True)
    )
    want = _greedy_hf(merged_dir, [g.prompt_ids for g in answers], 12)
    assert [g.responses[0].token_ids for g in answers] == want
    # and the adapter shows in them: the base model answers otherwise
    assert want != _greedy_hf(Path(learner.model_path), [g.prompt_ids for g in answers], 12)


def test_the_collective_transport_syncs_the_adapter_too(lora_stack):
    """The broadcast from rank 0 (gloo here) carries the adapter whole: one partition."""
    cfg, engines, learner = lora_stack
    _train(learner, _sample_sequences(engines, n_prompts=4, group_size=4, seed=7))
    transport = CollectiveTransport(learner, engines)
    entries = [e for bucket in transport.buckets for e in bucket]
    assert entries and all(".lora_" in name for name, _, _ in entries)
    assert transport.bytes_per_sync == sum(4 * torch.Size(shape).numel() for _, shape, _ in entries)
    _sync(transport, version=20)  # every adapter tensor's checksum matched


def test_a_lora_checkpoint_resumes_to_the_same_adapter_and_optimizer_state(lora_stack, tmp_path):
    cfg, engines, learner = lora_stack
    seqs = _sample_sequences(engines, n_prompts=6, group_size=4, seed=5)
    _train(learner, seqs)  # Adam's moments are not zero
    ray.get(learner.async_save_checkpoint(str(tmp_path / "ckpt")))
    saved = _saved(learner, tmp_path / "saved")
    # What a resume compares the checkpoint's adapter record with, in DeepSpeed's real files:
    # the record of this job passes, one of another rank is refused before anything starts.
    files = [str(f.relative_to(tmp_path)) for f in (tmp_path / "ckpt").rglob("*") if f.is_file()]
    record = adapter_shape(cfg.learner.lora)
    state_file = tmp_path / "driver_state.json"
    check_adapter_record(tmp_path, files, record, state_file)
    with pytest.raises(CheckpointError, match="provenance.adapter.rank is 16, but .*lora_A"):
        check_adapter_record(tmp_path, files, record | {"rank": 16}, state_file)
    more = _sample_sequences(engines, n_prompts=6, group_size=4, seed=6)
    _train(learner, more)
    moved = _saved(learner, tmp_path / "moved")
    assert any(not torch.equal(saved[k], moved[k]) for k in saved)

    learner.load_checkpoint(str(tmp_path / "ckpt"))
    restored = _saved(learner, tmp_path / "restored")
    assert all(torch.equal(saved[k], restored[k]) for k in saved)
    # The same step from the restored state lands on the same adapter: the optimizer's
    # state came back too (float32, exactly, on the CPU).
    _train(learner, more)
    again = _saved(learner, tmp_path / "again")
    assert all(torch.equal(moved[k], again[k]) for k in moved)
    # The checkpoint leaves the frozen model out: it is a small part of the model's size.
    ckpt_bytes = sum(f.stat().st_size for f in (tmp_path / "ckpt").rglob("*") if f.is_file())
    model_bytes = sum(f.stat().st_size for f in Path(learner.model_path).glob("*.safetensors"))
    assert ckpt_bytes < model_bytes / 4, (ckpt_bytes, model_bytes)
