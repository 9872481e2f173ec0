"""The real stack on the shared local Ray cluster: 2 vLLM engines, 2 DeepSpeed ZeRO-3 ranks."""

from __future__ import annotations

import pytest
import ray
import torch

from groupflow.actors.generator import start_generators
from groupflow.actors.learner import LearnerGroup
from groupflow.actors.transport import ObjectStoreTransport
from groupflow.config import build_config
from groupflow.records import TrainSequence
from groupflow.reward_workers.tasks import make_task
from groupflow.rollout.engine import SamplingSettings

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stack(ray_cluster, quickstart_model):
    cfg = build_config({}, ["rollout.num_engines=2", "learner.optimizer.lr=1e-3"])
    engines = start_generators(cfg, quickstart_model)
    learner = LearnerGroup(cfg, quickstart_model)
    yield cfg, engines, learner
    learner.shutdown()
    for e in engines:
        ray.kill(e)


def _sample_sequences(engines, n_prompts=8, group_size=4, seed=0):
    task = make_task("arithmetic")
    prompts = [p for p, _ in zip(task.train_prompts(seed), range(n_prompts), strict=False)]
    groups = ray.get(
        engines[0].sample.remote(prompts, group_size, SamplingSettings(temperature=1.0))
    )
    seqs = []
    for gid, g in enumerate(groups):
        rewards = [task.verify(g.prompt, r.text).reward for r in g.responses]
        mean = sum(rewards) / len(rewards)
        for r, resp in zip(rewards, g.responses, strict=True):
            seqs.append(
                TrainSequence(
                    g.prompt_ids + resp.token_ids,
                    len(g.prompt_ids),
                    r - mean + 0.1,
                    r,
                    gid,
                    g.policy_version,
                    resp.logprobs,
                )
            )
    return seqs


def _expected_vllm_params(hf: dict[str, torch.Tensor], vllm_names) -> dict[str, torch.Tensor]:
    """The learner's parameters laid out as vLLM fuses them (qkv, gate_up)."""
    out = {}
    for name in vllm_names:
        if "qkv_proj" in name:
            parts = [name.replace("qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj")]
            out[name] = torch.cat([hf[p] for p in parts])
        elif "gate_up_proj" in name:
            out[name] = torch.cat(
                [hf[name.replace("gate_up_proj", p)] for p in ("gate_proj", "up_proj")]
            )
        elif name == "lm_head.weight" and name not in hf:
            out[name] = hf["model.embed_tokens.weight"]  # tied embeddings
        else:
            out[name] = hf[name]
    return out


def test_weight_sync_is_exact_on_every_engine(stack):
    cfg, engines, learner = stack
    before = dict(ray.get(learner.publish_weights()))
    results = learner.train_step(_sample_sequences(engines))
    assert all(r.optimizer_updates == 1 for r in results)
    ObjectStoreTransport().sync(learner, engines, version=1)
    after = dict(ray.get(learner.publish_weights()))
    assert any(not torch.equal(before[k], after[k]) for k in after), "the step changed nothing"
    _assert_engines_match(engines, after)


def _assert_engines_match(engines, after: dict[str, torch.Tensor]) -> None:
    for engine in engines:
        snap = ray.get(engine.parameters_snapshot.remote())
        expected = _expected_vllm_params(after, snap)
        assert snap.keys() == expected.keys() and len(snap) > 10
        for name, value in snap.items():
            want = expected[name]
            if "embed_tokens" in name or "lm_head" in name:
                # vLLM pads the vocabulary to a multiple of its tile size with zero rows
                assert not value[want.shape[0] :].any(), name
                value = value[: want.shape[0]]
            assert value.shape == want.shape and torch.equal(value, want), name


def test_vllm_logprobs_match_the_learner(stack):
    cfg, engines, learner = stack
    ObjectStoreTransport().sync(learner, engines, version=2)
    seqs = _sample_sequences(engines, seed=1)
    assert sum(len(s.vllm_logprobs) for s in seqs) > 20
    results = learner.train_step(seqs)
    worst = max(r.sums["logp_mismatch_max"] for r in results)
    mean = sum(r.sums["logp_mismatch"] for r in results) / sum(r.counts["tokens"] for r in results)
    assert worst < 1e-3, (worst, mean)


def test_micro_batches_and_ranks_give_the_one_batch_gradient(stack):
    """Same loss, same parameters: 2 ZeRO-3 ranks x 3 micro-batches vs one plain-torch batch."""
    from transformers import AutoModelForCausalLM

    from groupflow.learner.credit import LocalReducer, plan_credit
    from groupflow.learner.token_stats import token_stats
    from groupflow.learner.rank import _pad_tokens

    cfg, engines, learner = stack
    seqs = _sample_sequences(engines, n_prompts=6, group_size=4, seed=2)
    weights = dict(ray.get(learner.publish_weights()))

    model = AutoModelForCausalLM.from_pretrained(learner.model_path, dtype=torch.float32)
    model.load_state_dict(weights, strict=False)
    model.tie_weights()
    per_seq = []
    for s in seqs:
        logits = model(input_ids=torch.tensor([s.input_ids])).logits[0]
        pos = torch.arange(s.prompt_len - 1, len(s.input_ids) - 1)
        per_seq.append(token_stats(logits[pos], torch.tensor(s.input_ids)[pos + 1], 1.0))
    frozen = [type(t)(t.logp.detach(), t.entropy, t.sum_p2) for t in per_seq]
    plan = plan_credit(_pad_tokens(seqs, frozen, frozen, "cpu"), cfg.algorithm, LocalReducer())
    from groupflow.learner.losses import token_loss

    logp = torch.nn.utils.rnn.pad_sequence([t.logp for t in per_seq], batch_first=True)
    old = torch.nn.utils.rnn.pad_sequence([t.logp for t in frozen], batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence(
        [torch.ones_like(t.logp) for t in per_seq], batch_first=True
    )
    loss = (plan.stages[0] * token_loss(logp, old, plan.token_adv, mask, cfg.algorithm).loss).sum()
    loss.backward()
    expected = torch.sqrt(sum((p.grad**2).sum() for p in model.parameters() if p.grad is not None))

    # groups 0-2 on rank 0, groups 3-5 on rank 1; each rank's share in 3 uneven micro-batches
    rank0, rank1 = seqs[:12], seqs[12:]
    shares = [[[rank0[:2], rank0[2:9], rank0[9:]]], [[rank1[:5], rank1[5:6], rank1[6:]]]]
    results = ray.get(
        [r.train_step.remote(sh) for r, sh in zip(learner.ranks, shares, strict=True)]
    )
    got = results[0].grad_norms[0]
    assert got == pytest.approx(expected.item(), rel=1e-4), (got, expected.item())


def test_collective_transport_syncs_exactly_too(stack):
    """The broadcast transport (gloo here, NCCL on GPUs) lands the same bits as the learner."""
    from groupflow.actors.transport import CollectiveTransport

    cfg, engines, learner = stack
    learner.train_step(_sample_sequences(engines, seed=3))
    transport = CollectiveTransport()
    transport.sync(learner, engines, version=10)
    learner.train_step(_sample_sequences(engines, seed=4))
    transport.sync(learner, engines, version=11)  # the group is reused
    _assert_engines_match(engines, dict(ray.get(learner.publish_weights())))
