"""Sampling settings and chat prompts on a real vLLM engine: one engine serves every test."""

from __future__ import annotations

import pytest
import ray

from groupflow.actors.generator import start_generator_pool
from groupflow.config import SamplingConfig
from groupflow.core.records import ScoredGroup, Verdict
from groupflow.loop.sequences import group_advantages, train_sequences
from groupflow.reward_workers.tasks import make_task
from groupflow.run.job_config import build_config, small_model_config
from tests.conftest import CHAT_SYSTEM_PROMPT as SYSTEM

pytestmark = pytest.mark.integration

GROUP = 6


@pytest.fixture(scope="module")
def engine(ray_cluster, chat_model):
    cfg = small_model_config({"task": {"system_prompt": SYSTEM}})
    pool = start_generator_pool(cfg, chat_model)
    yield pool.engines[0]
    pool.shutdown()


@pytest.fixture(scope="module")
def prompts():
    task = make_task("arithmetic")
    return [p for p, _ in zip(task.train_prompts(seed=7), range(6), strict=False)]


def _sample(engine, prompts, **sampling):
    return ray.get(
        engine.sample.remote(prompts, GROUP, SamplingConfig(**{"max_tokens": 16, **sampling}))
    )


def test_engine_and_learner_see_the_chat_rendering(engine, chat_model, prompts):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    groups = _sample(engine, prompts)
    scored = [ScoredGroup(g, [Verdict(float(j % 2), "") for j in range(GROUP)]) for g in groups]
    cfg = build_config({})
    seqs = train_sequences(scored, group_advantages(scored, cfg), cfg.algorithm)
    for g, p in zip(groups, prompts, strict=True):
        text = f"S({SYSTEM}) U({p.messages[0]['content']}) A("
        assert g.prompt_ids == tokenizer.encode(text, add_special_tokens=False)
    for s in seqs:
        group = groups[s.group_id]
        assert s.input_ids[: s.prompt_len] == group.prompt_ids  # what the learner trains on


def test_a_seed_repeats_the_samples_and_no_seed_does_not(engine, prompts):
    seeded = [_sample(engine, prompts, seed=11) for _ in range(2)]
    ids = [[[r.token_ids for r in g.responses] for g in run] for run in seeded]
    assert ids[0] == ids[1]
    # the G responses of one request still differ from each other
    assert any(len({tuple(t) for t in group}) > 1 for group in ids[0])
    other = _sample(engine, prompts, seed=12)
    assert [[r.token_ids for r in g.responses] for g in other] != ids[0]


def test_top_k_1_and_min_p_1_leave_only_the_likeliest_token(engine, prompts):
    for setting in ({"top_k": 1}, {"min_p": 1.0}):
        for g in _sample(engine, prompts, **setting):
            assert len({tuple(r.token_ids) for r in g.responses}) == 1, setting


def test_stop_strings_and_the_length_limit_set_the_finish_reason(engine, prompts):
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


def test_a_prompt_of_a_task_with_its_own_limit_stops_there(engine, prompts):
    from dataclasses import replace

    short = [replace(p, max_tokens=2) for p in prompts[:3]]
    groups = _sample(engine, short + prompts[3:], max_tokens=12)
    assert all(len(r.token_ids) <= 2 for g in groups[:3] for r in g.responses)
    assert any(len(r.token_ids) > 2 for g in groups[3:] for r in g.responses)
