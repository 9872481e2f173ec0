"""The real stack on the shared local Ray cluster: 2 vLLM engines, 2 DeepSpeed ZeRO-3 ranks, on
the quickstart model as a chat model (tests/conftest.py's chat_model, with a system turn): the
sampling settings and the chat rendering first, on the fresh engines, then weight syncs and
learner steps."""

from __future__ import annotations

import os
import time

import pytest
import ray
import torch

from groupflow.actors.generator import start_generator_pool
from groupflow.actors.learner import LearnerGroup
from groupflow.actors.transport_collective import CollectiveTransport
from groupflow.actors.transport_object_store import (
    ObjectStoreTransport,
    load_streamed,
    push_partitions,
    receive_part,
)
from groupflow.config import SamplingConfig
from groupflow.core.records import Prompt, ScoredGroup, TrainSequence, Verdict
from groupflow.core.sync_probe import SyncProbeMismatch
from groupflow.core.weight_format import WeightSyncMismatch, bucket_manifest
from groupflow.loop.sequences import group_advantages, train_sequences
from groupflow.reward_workers.tasks import make_task
from groupflow.run.job_config import build_config, small_model_config
from tests.conftest import CHAT_SYSTEM_PROMPT as SYSTEM
from tests.integration.learner_weights import learner_weights

pytestmark = pytest.mark.integration

SHORT = SamplingConfig(max_tokens=16)  # the quickstart's answers are a few digits
CHAT = {"task": {"system_prompt": SYSTEM}}  # every prompt rendered with a system turn


@pytest.fixture(scope="module")
def stack(ray_cluster, chat_model):
    cfg = small_model_config(
        CHAT,
        ["rollout.num_engines=2", "learner.optimizer.lr=1e-3", "rollout.partial_rollout=true"],
    )
    pool = start_generator_pool(cfg, chat_model)
    learner = LearnerGroup(cfg, chat_model)
    yield cfg, pool.engines, learner
    learner.shutdown()
    pool.shutdown()


def _train(learner, seqs):
    """One blocking step: each rank's figures."""
    return ray.get(learner.async_train_step(seqs))


def _sync(transport, version: int) -> list:
    """A sync, every engine's load checked against the learner's checksums: what each engine
    loaded (LoadedWeights)."""
    handles = transport.async_sync(version, transport.engines)
    ray.get(handles.learner, timeout=300)
    loaded = ray.get(handles.engines, timeout=300)
    for handle, value in zip(handles.engines, loaded, strict=True):
        assert transport.check_load(handle, value), "verified"
    return loaded


def _sample_sequences(engines, n_prompts=8, group_size=4, seed=0):
    task = make_task("arithmetic")
    prompts = [p for p, _ in zip(task.train_prompts(seed), range(n_prompts), strict=False)]
    groups = ray.get(
        engines[0].sample.remote(
            prompts, group_size, SamplingConfig(temperature=1.0, max_tokens=16)
        )
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


# ----- sampling settings and chat prompts, on the fresh engines ------------------------------

GROUP = 6


@pytest.fixture(scope="module")
def prompts():
    task = make_task("arithmetic")
    return [p for p, _ in zip(task.train_prompts(seed=7), range(6), strict=False)]


def _sample(engine, prompts, **sampling):
    return ray.get(
        engine.sample.remote(prompts, GROUP, SamplingConfig(**{"max_tokens": 16, **sampling}))
    )


def test_engine_and_learner_see_the_chat_rendering(stack, chat_model, prompts):
    from transformers import AutoTokenizer

    _, engines, _ = stack
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    groups = _sample(engines[0], prompts)
    scored = [ScoredGroup(g, [Verdict(float(j % 2), "") for j in range(GROUP)]) for g in groups]
    cfg = build_config({})
    seqs = train_sequences(scored, group_advantages(scored, cfg), cfg.algorithm)
    for g, p in zip(groups, prompts, strict=True):
        text = f"S({SYSTEM}) U({p.messages[0]['content']}) A("
        assert g.prompt_ids == tokenizer.encode(text, add_special_tokens=False)
    for s in seqs:
        group = groups[s.group_id]
        assert s.input_ids[: s.prompt_len] == group.prompt_ids  # what the learner trains on


def test_a_seed_repeats_the_samples_and_no_seed_does_not(stack, prompts):
    engine = stack[1][0]
    seeded = [_sample(engine, prompts, seed=11) for _ in range(2)]
    ids = [[[r.token_ids for r in g.responses] for g in run] for run in seeded]
    assert ids[0] == ids[1]
    # the G responses of one request still differ from each other
    assert any(len({tuple(t) for t in group}) > 1 for group in ids[0])
    other = _sample(engine, prompts, seed=12)
    assert [[r.token_ids for r in g.responses] for g in other] != ids[0]


def test_top_k_1_and_min_p_1_leave_only_the_likeliest_token(stack, prompts):
    for setting in ({"top_k": 1}, {"min_p": 1.0}):
        for g in _sample(stack[1][0], prompts, **setting):
            assert len({tuple(r.token_ids) for r in g.responses}) == 1, setting


def test_stop_strings_and_the_length_limit_set_the_finish_reason(stack, prompts):
    engine = stack[1][0]
    for g in _sample(engine, prompts, stop=["1"], max_tokens=12):
        for r in g.responses:
            assert "1" not in r.text[:-1]
            if r.finish_reason == "stop" and r.text.endswith("1"):
                continue
            assert r.finish_reason in {"stop", "length"} and "1" not in r.text

    # greedy evaluation ends its answers where training does: at the stop string, kept
    def greedy(**sampling):
        groups = engine.complete.remote(prompts, 1, SamplingConfig(max_tokens=12, **sampling), True)
        return [g.responses[0].text for g in ray.get(groups)]

    full = greedy()
    longest = max(full, key=len)
    stop = longest[len(longest) // 2]  # a character the greedy answers do write
    assert len(longest) >= 2, full
    cut = [t[: t.index(stop) + 1] if stop in t else t for t in full]
    assert greedy(stop=[stop]) == cut and cut != full
    one = [r for g in _sample(engine, prompts, max_tokens=1) for r in g.responses]
    assert all(len(r.token_ids) == 1 for r in one)
    # a one-token answer that is not EOS was cut at the limit
    assert {r.finish_reason for r in one if r.text} == {"length"}


def test_a_prompt_of_a_task_with_its_own_limit_stops_there(stack, prompts):
    from dataclasses import replace

    short = [replace(p, max_tokens=2) for p in prompts[:3]]
    groups = _sample(stack[1][0], short + prompts[3:], max_tokens=12)
    assert all(len(r.token_ids) <= 2 for g in groups[:3] for r in g.responses)
    assert any(len(r.token_ids) > 2 for g in groups[3:] for r in g.responses)


def _threads(actor) -> tuple[int, str]:
    """Run in an actor (its `weight_sync` runs a function there): torch's intra-op threads and
    the tokenizers' pool, as the process runs them."""
    return torch.get_num_threads(), os.environ["RAYON_NUM_THREADS"]


def test_each_actor_runs_the_threads_of_its_own_resources(stack):
    """Not one a core of the node: the engines' and the ranks' half a CPU is one thread, for
    torch and for the tokenizers alike (tests/unit/test_threads.py derives larger counts)."""
    cfg, engines, learner = stack
    assert cfg.rollout.resources.num_cpus == cfg.learner.resources.num_cpus == 0.5
    engine_threads = ray.get([e.weight_sync.remote(_threads) for e in engines])
    rank_threads = ray.get([r.weight_sync.remote(_threads) for r in learner.ranks])
    assert engine_threads == rank_threads == [(1, "1")] * 2


# ----- weight syncs and learner steps ---------------------------------------------------------


def test_weight_sync_is_exact_on_every_engine(stack):
    cfg, engines, learner = stack
    before = learner_weights(learner)
    results = _train(learner, _sample_sequences(engines))
    assert all(r.optimizer_updates == 1 for r in results)
    _sync(ObjectStoreTransport(learner, engines), version=1)
    after = learner_weights(learner)
    assert any(not torch.equal(before[k], after[k]) for k in after), "the step changed nothing"
    _assert_engines_match(engines, after)


@ray.remote(num_cpus=0)
class CorruptingEngine:
    """Stands between the learner ranks and an engine: the first bucket's partition of
    learner rank 0 reaches the engine with one bit flipped, its first element's lowest bit (a
    change vLLM loads silently, the engine samples on)."""

    def __init__(self, engine):
        self.engine = engine
        self.corrupted = False

    async def weight_sync(self, step, *args):
        if step is receive_part:
            sync, index, rank, part = args
            if part is not None and (index, rank) == (0, 0):
                array = (await part[0]).copy()
                array[0] ^= 1
                args = (sync, index, rank, [ray.put(array)])
                self.corrupted = True
        return await self.engine.weight_sync.remote(step, *args)

    def has_corrupted(self) -> bool:
        return self.corrupted


def test_a_corrupted_bucket_is_caught_by_the_checksum_and_named(stack):
    cfg, engines, learner = stack
    corrupting = CorruptingEngine.remote(engines[1])
    transport = ObjectStoreTransport(learner, [engines[0], corrupting])
    # the version the engines hold: later tests count on the engines being at version 1 here
    handles = transport.async_sync(1, transport.engines)
    ray.get(handles.learner, timeout=300)
    loaded = ray.get(handles.engines, timeout=300)
    assert ray.get(corrupting.has_corrupted.remote())
    assert transport.check_load(handles.engines[0], loaded[0])
    first = transport.buckets[0][0][0]  # the bucket's first tensor holds the flipped bit
    with pytest.raises(WeightSyncMismatch) as err:
        transport.check_load(handles.engines[1], loaded[1])
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("weight sync of policy version 1: engine 1 (actor ")
    assert f"tensor {first}: loaded checksum" in line
    # a clean sync makes the engine whole again, verified
    _sync(ObjectStoreTransport(learner, engines), version=1)
    _assert_engines_match(engines, learner_weights(learner))


def _misplace_gate_and_up(generator, layer: int) -> None:
    """In an engine's process (Ray's __ray_call__ on its Generator): from now on its vLLM
    model loads layer `layer`'s gate projection where the up projection goes and the up
    projection where the gate goes, a name mapping gone wrong past the checksums."""
    worker = generator.engine.llm.llm_engine.model_executor.driver_worker.worker
    model = worker.model_runner.get_model()
    load_weights = model.load_weights
    names = [f"model.layers.{layer}.mlp.{p}_proj.weight" for p in ("gate", "up")]
    swap = dict(zip(names, reversed(names), strict=True))
    model.load_weights = lambda weights: load_weights((swap.get(n, n), t) for n, t in weights)


def _place_rightly(generator) -> None:
    worker = generator.engine.llm.llm_engine.model_executor.driver_worker.worker
    del worker.model_runner.get_model().load_weights  # the class's own again


def test_a_tensor_loaded_into_the_wrong_place_is_caught_by_the_sync_probe(stack):
    """The bytes every engine loads are the learner's, so every checksum matches; but one
    engine's vLLM puts two tensors in each other's place. What that engine computes differs
    from the learner, which its log-probs of the sync probe show: one line naming the engine,
    the version and the worst token. A clean sync makes it agree again."""
    cfg, engines, learner = stack
    ray.get(engines[1].__ray_call__.remote(_misplace_gate_and_up, 1))
    try:
        transport = ObjectStoreTransport(learner, engines)
        handles = transport.async_sync(1, transport.engines)  # the version the engines hold
        ray.get(handles.learner, timeout=300)
        loaded = ray.get(handles.engines, timeout=300)
    finally:
        ray.get(engines[1].__ray_call__.remote(_place_rightly))
    assert loaded[0].checksums == loaded[1].checksums, "both engines loaded the same bytes"
    assert transport.check_load(handles.engines[0], loaded[0])
    with pytest.raises(SyncProbeMismatch) as err:
        transport.check_load(handles.engines[1], loaded[1])
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("weight sync of policy version 1: engine 1 (actor ")
    assert "computes other log-probs than the learner" in line and "worst at token" in line
    transport = ObjectStoreTransport(learner, engines)
    _sync(transport, version=1)
    assert transport.probe_figures()["sync_probe_diff_max"] < 1e-5


def test_engines_load_buckets_sent_while_they_sample_and_abandon_a_broken_stream(
    stack, quickstart_model
):
    """The engine's load starts while a chunk samples, before the buckets arrive: the
    references reach it meanwhile and it loads exactly, without waiting for the chunk (a
    partial rollout): a response generating across the load carries both versions, split
    where the load landed, and its group the older one; each of its tokens' log-probs (what
    the learner's off-policy correction divides by) is that of the version that sampled it.
    A chunk sent after the load starts after it. A sync whose stream breaks ends the load
    instead of leaving the engine waiting."""
    cfg, engines, learner = stack
    before = ray.get(engines[0].sample.remote([Prompt("v", "1+1=", 2)], 2, SHORT))
    old = before[0].policy_version
    weights = {old: learner_weights(learner)}  # what the engines hold (the last test synced them)
    _train(learner, _sample_sequences(engines, seed=5))
    # Responses of 200 tokens each (after a chat prompt of about 40), still generating when the
    # load lands.
    long = SamplingConfig(temperature=1.0, max_tokens=200, ignore_eos=True)
    chunk = engines[0].sample.remote([Prompt(f"long{i}", "1+1=", 2) for i in range(4)], 8, long)
    time.sleep(0.5)
    _sync(ObjectStoreTransport(learner, engines, bucket_bytes=2**20), version=2)
    after = engines[0].sample.remote([Prompt("after-load", "1+1=", 2)], 2, SHORT)
    groups = ray.get(chunk)
    assert all(g.policy_version == old for g in groups), "the chunk started before the load"
    straddling = [r for g in groups for r in g.responses if len(r.versions) > 1]
    assert straddling, [r.versions for g in groups for r in g.responses]
    for response in straddling:
        (v0, first), (v1, split) = response.versions
        assert (v0, first, v1) == (old, 0, 2) and 0 < split < len(response.token_ids)
    assert [r.versions for r in ray.get(after)[0].responses] == [[(2, 0)]] * 2
    weights[2] = learner_weights(learner)
    _assert_engines_match(engines, weights[2])
    group = next(g for g in groups if any(len(r.versions) > 1 for r in g.responses))
    response = next(r for r in group.responses if len(r.versions) > 1)
    by_version = _token_logprobs(quickstart_model, group.prompt_ids, response.token_ids, weights)
    split = response.versions[1][1]
    sampled = torch.tensor(response.logprobs, dtype=torch.float64)
    for span, version, other in ((slice(0, split), old, 2), (slice(split, None), 2, old)):
        own = (sampled[span] - by_version[version][span]).abs()
        off = (sampled[span] - by_version[other][span]).abs()
        assert own.max() < 1e-3 and own.mean() < off.mean() / 4, (version, own, off)

    # A sync whose rank fails after its first bucket, of weights a step newer: the engine
    # abandons the load (the learner's side reports the failure) and still samples (the
    # layers not loaded keep their weights) until a whole sync makes it exact again. The
    # ranks push the first bucket only, and rank 0 then says it failed at the second.
    _train(learner, _sample_sequences(engines, seed=6))
    manifest = ray.get(learner.ranks[0].weight_manifest.remote())
    buckets = bucket_manifest(manifest, 2**20)
    assert len(buckets) > 1
    pushes = push_partitions(learner.ranks, buckets[:1], "broken", [engines[0]])
    load = engines[0].weight_sync.remote(load_streamed, buckets, 3, "broken", pushes)
    ray.get(pushes)
    engines[0].weight_sync.remote(receive_part, "broken", 1, 0, None)
    assert ray.get(load, timeout=120) is None, "the load is abandoned, not failed"
    groups = ray.get(engines[0].sample.remote([Prompt("after", "1+1=", 2)], 2, SHORT))
    assert len(groups[0].responses) == 2
    # A rank lost in a sync (its push's handle fails) abandons the load just as well.
    lost = [_lost_rank.remote(), _lost_rank.remote()]
    assert ray.get(engines[0].weight_sync.remote(load_streamed, buckets, 4, "lost", lost)) is None
    _sync(ObjectStoreTransport(learner, engines), version=4)
    _assert_engines_match(engines, learner_weights(learner))


@ray.remote(num_cpus=0)
def _lost_rank() -> None:
    raise RuntimeError("a learner rank died")


def _token_logprobs(
    model_path: str, prompt_ids: list[int], token_ids: list[int], weights: dict
) -> dict[int, torch.Tensor]:
    """Each version's log-probs (temperature 1) of the response's tokens, by a forward of
    Hugging Face's model with that version's weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
    ids = torch.tensor([prompt_ids + token_ids])
    out = {}
    for version, named in weights.items():
        missing, unexpected = model.load_state_dict(named, strict=False)
        assert not unexpected and all("lm_head" in name for name in missing)
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].to(torch.float64)
        picked = logits.log_softmax(-1).gather(-1, torch.tensor(token_ids).unsqueeze(-1))
        out[version] = picked.squeeze(-1)
    return out


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
    _sync(ObjectStoreTransport(learner, engines), version=2)
    seqs = _sample_sequences(engines, seed=1)
    assert sum(len(s.vllm_logprobs) for s in seqs) > 20
    results = _train(learner, seqs)
    worst = max(r.proximal.logp_mismatch_max for r in results)
    mean = sum(r.proximal.logp_mismatch for r in results) / sum(r.proximal.tokens for r in results)
    assert worst < 1e-3, (worst, mean)
    # The off-policy figures see the same tokens: weights within that mismatch of 1.
    off_policy = [r.off_policy for r in results]
    assert sum(f.tokens for f in off_policy) == sum(r.proximal.tokens for r in results)
    assert max(f.weight_max for f in off_policy) < 1.01
    assert 0 <= sum(f.kl for f in off_policy) / sum(f.tokens for f in off_policy) < 1e-5


def _one_batch_grad_norm(cfg, model_path: str, weights, seqs) -> float:
    """The gradient norm of the step's loss as one batch through a plain torch model."""
    from transformers import AutoModelForCausalLM

    from groupflow.learner.credit import LocalReducer, plan_credit
    from groupflow.learner.losses import token_loss
    from groupflow.learner.step import mini_batch_tokens
    from groupflow.learner.token_stats import TokenStats, token_stats

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.load_state_dict(weights, strict=False)
    model.tie_weights()
    per_seq = []
    for s in seqs:
        logits = model(input_ids=torch.tensor([s.input_ids])).logits[0]
        pos = torch.arange(s.prompt_len - 1, len(s.input_ids) - 1)
        per_seq.append(token_stats(logits[pos], torch.tensor(s.input_ids)[pos + 1], 1.0))
    frozen = [TokenStats(t.logp.detach(), t.entropy, t.sum_p2) for t in per_seq]
    tokens = mini_batch_tokens(seqs, frozen, frozen, torch.device("cpu"))
    plan = plan_credit(tokens, cfg.algorithm, LocalReducer())
    logp = torch.nn.utils.rnn.pad_sequence([t.logp for t in per_seq], batch_first=True)
    out = token_loss(logp, tokens.old_logp, plan.token_adv, tokens.mask, cfg.algorithm)
    (plan.passes[0] * out.loss).sum().backward()
    return torch.sqrt(sum((p.grad**2).sum() for p in model.parameters() if p.grad is not None))


# [rank][mini-batch][micro-batch]; groups 0-2 (rows 0-11) on rank 0, groups 3-5 on rank 1
LAYOUTS = {
    # several micro-batches: the plan's statistics from a separate behaviour forward
    "uneven-micro-batches": lambda s: [[[s[:2], s[2:9], s[9:12]]], [[s[12:17], s[17:18], s[18:]]]],
    # one micro-batch per rank: old_logp from the update's own forward
    "one-micro-batch": lambda s: [[[s[:12]]], [[s[12:]]]],
    # rank 1 holds nothing and runs ZeRO-3's empty micro-batch in its place
    "one-rank-idle": lambda s: [[[s]], [[[]]]],
}


@pytest.mark.parametrize("cut", sorted(LAYOUTS))
def test_micro_batches_and_ranks_give_the_one_batch_gradient(stack, cut):
    """Same loss, same parameters: 2 ZeRO-3 ranks, the step cut as `cut`, vs one plain-torch
    batch."""
    cfg, engines, learner = stack
    seqs = _sample_sequences(engines, n_prompts=6, group_size=4, seed=2)
    expected = _one_batch_grad_norm(cfg, learner.model_path, learner_weights(learner), seqs)
    shares = LAYOUTS[cut](seqs)
    results = ray.get(
        [r.train_step.remote(sh) for r, sh in zip(learner.ranks, shares, strict=True)]
    )
    got = results[0].grad_norms[0]
    assert got == pytest.approx(expected.item(), rel=1e-4), (got, expected.item())
    assert results[0].grad_norms == results[1].grad_norms  # a global figure


def test_collective_transport_syncs_exactly_too(stack):
    """The broadcast transport (gloo here, NCCL on GPUs) lands the same bits as the learner."""
    cfg, engines, learner = stack
    _train(learner, _sample_sequences(engines, seed=3))
    transport = CollectiveTransport(learner, engines)
    _sync(transport, version=10)
    _train(learner, _sample_sequences(engines, seed=4))
    _sync(transport, version=11)  # the group is reused
    _assert_engines_match(engines, learner_weights(learner))


def test_a_tensor_parallel_engine_samples_what_a_one_device_engine_does_after_a_sync(stack):
    """TP = 2 on this CPU (vLLM's multiprocess executor, a worker per core): after a verified
    sync of trained weights, its greedy answers are the one-device engine's."""
    cfg, engines, learner = stack
    tp_cfg = small_model_config(CHAT, ["rollout.tensor_parallel_size=2"])
    tp_pool = start_generator_pool(tp_cfg, learner.model_path)
    try:
        transport = ObjectStoreTransport(learner, [engines[0], *tp_pool.engines])
        _train(learner, _sample_sequences(engines, seed=7))
        first = _sync(transport, version=19)[1].workers
        _train(learner, _sample_sequences(engines, seed=8))
        steady = _sync(transport, version=20)[1].workers
        # each worker received its own part of each tensor only (rollout/shard_stream.py), and
        # never held a second whole model. A job's loads are judged at their steady state: a
        # worker's first load also pays one-time resident memory (lazy imports, allocator
        # arenas: about 1 MB here), which is most of a shard of this 9 MB model.
        whole = sum(t.numel() * t.element_size() for t in learner_weights(learner).values())
        for workers in (first, steady):
            assert [w.rank for w in workers] == [0, 1]
            for w in workers:
                assert w.received_bytes < 0.6 * whole, (w, whole)
                assert w.peak_extra_bytes < w.received_bytes + 0.5 * whole, (w, whole)
        for w in steady:
            assert w.peak_extra_bytes < 1.2 * w.received_bytes, (w, whole)
        print(f"TP=2 loads: model {whole} bytes, first {first}, steady {steady}")
        prompts = make_task("arithmetic").eval_prompts(24)
        one_device, tensor_parallel = ray.get(
            [
                e.complete.remote(prompts, 1, cfg.rollout.sampling, True)
                for e in [engines[0], tp_pool.engines[0]]
            ]
        )
        assert {g.policy_version for g in one_device + tensor_parallel} == {20}
        assert [g.responses[0].token_ids for g in tensor_parallel] == [
            g.responses[0].token_ids for g in one_device
        ]
        # each worker holds a shard: worker 0's fused q/k/v projection is half the whole
        qkv = "model.layers.0.self_attn.qkv_proj.weight"
        shard, whole = (
            ray.get(e.parameters_snapshot.remote())[qkv] for e in (tp_pool.engines[0], engines[0])
        )
        assert 2 * shard.shape[0] == whole.shape[0]
    finally:
        tp_pool.shutdown()


def test_a_rank_dead_in_a_sync_fails_the_learners_side_and_the_engines_abandon_it(stack):
    """A rank killed before a sync: the learner's handle fails as a death (the job rebuilds
    the learner), and the engines abandon their loads rather than fail them, which would read
    as a failure of theirs. (Last in this module: it leaves the learner a rank short; that an
    engine samples on after an abandoned load and a later sync makes it exact is the test
    of a broken stream above.)"""
    cfg, engines, learner = stack
    ray.kill(learner.ranks[1])
    handles = ObjectStoreTransport(learner, engines, bucket_bytes=2**20).async_sync(5, engines)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(handles.learner, timeout=120)
    assert ray.get(handles.engines, timeout=120) == [None] * len(engines), "abandoned"
