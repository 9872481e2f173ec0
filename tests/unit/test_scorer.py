"""The Scorer: task verifier or plugin per response, in killable scorer processes, and the
error/timeout counters."""

import logging
import time

import pytest

from groupflow.actors.reward import RewardWorker
from groupflow.core.records import Prompt, Response, SampledGroup, Verdict
from groupflow.reward_workers.scorer import Scorer, response_items, scored_groups
from groupflow.reward_workers.verifier_pool import DEADLINE_MARGIN_S

PLUGIN = """
import time
def reward(prompt, response, answer):
    if response == 'hang':
        time.sleep(30)
    if response == 'boom':
        raise RuntimeError('boom')
    if response == 'die':
        import os
        os._exit(1)
    return float(response == 'yes')
"""


def group(prompt, *texts):
    responses = [Response(token_ids=[1], text=t, logprobs=[-0.1]) for t in texts]
    return SampledGroup(prompt=prompt, prompt_ids=[0], responses=responses, policy_version=3)


@pytest.fixture
def plugin_scorer(tmp_path):
    path = tmp_path / "plugin.py"
    path.write_text(PLUGIN)
    scorer = Scorer("arithmetic", plugin=f"{path}:reward", timeout_s=0.3, processes=2)
    yield scorer
    scorer.close()


def test_scores_a_group_with_the_task_verifier():
    scorer = Scorer("arithmetic", {"digits": 2})
    sampled = group(Prompt("37+45", "37+45=", 82), "82", "81", "")
    (scored,) = scorer.score_groups([sampled])
    scorer.close()
    assert scored.group is sampled
    assert scored.rewards == [1.0, 0.0, 0.0]
    assert (scorer.errors, scorer.timeouts) == (0, 0)


def test_a_plugin_replaces_the_verifier_and_failures_are_counted(plugin_scorer, caplog):
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="groupflow.reward_workers.scorer"):
        (scored,) = plugin_scorer.score_groups(
            [group(Prompt("1+1", "1+1=", 2), "yes", "2", "boom", "hang", "hang", "die", "yes")]
        )
    # two hangs side by side in two processes, each ended at its deadline
    assert time.monotonic() - start < 30
    assert scored.rewards == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    errors = [v.error for v in scored.verdicts]
    assert errors == [None, None, "error", "timeout", "timeout", "error", None]
    assert (plugin_scorer.errors, plugin_scorer.timeouts) == (2, 2)
    assert plugin_scorer.pool.restarts == 3
    # each kind of failure is logged once
    assert len([r for r in caplog.records if "timeout" in r.getMessage()]) == 1


def test_a_batch_budget_ends_the_batch(plugin_scorer):
    prompt = Prompt("1+1", "1+1=", 2)
    start = time.monotonic()
    items = [(prompt, text) for text in ("hang", "hang", "hang", "yes")]
    verdicts = list(plugin_scorer.score_stream(items, 0.5))
    elapsed = time.monotonic() - start
    assert elapsed < 0.5 + DEADLINE_MARGIN_S + 5  # loose: the machine is shared
    assert [v.error for v in verdicts][:3] == ["timeout"] * 3
    # whatever happened before, the next correct answer scores 1
    assert plugin_scorer.score_groups([group(prompt, "yes")])[0].rewards == [1.0]


def test_a_reward_worker_gets_prompt_and_text_and_returns_verdicts_and_counters(tmp_path):
    path = tmp_path / "plugin.py"
    path.write_text(PLUGIN)
    worker = RewardWorker("arithmetic", {}, f"{path}:reward", plugin_timeout_s=0.3, processes=2)
    try:
        groups = [
            group(Prompt("1+1", "1+1=", 2), "yes", "boom"),
            group(Prompt("2+2", "", 4), "hang"),
        ]
        items = response_items(groups)
        assert items == [
            (groups[0].prompt, "yes"),
            (groups[0].prompt, "boom"),
            (groups[1].prompt, "hang"),
        ]
        verdicts, errors, timeouts = worker.score(items, time.time() + 10)
    finally:
        worker.scorer.close()
    assert all(isinstance(v, Verdict) for v in verdicts)
    assert [v.reward for v in verdicts] == [1.0, 0.0, 0.0] and (errors, timeouts) == (1, 1)
    # the pool puts the verdicts back with the groups it kept, in order
    scored = scored_groups(groups, verdicts)
    assert [s.group for s in scored] == groups and [s.rewards for s in scored] == [
        [1.0, 0.0],
        [0.0],
    ]
    with pytest.raises(ValueError, match="2 verdicts for 3 responses"):
        scored_groups(groups, verdicts[:2])


def test_bad_configuration_fails_at_construction(tmp_path):
    with pytest.raises(ValueError, match="unknown task"):
        Scorer("chess")
    with pytest.raises(ValueError, match="reward plugin"):
        Scorer("arithmetic", plugin="nowhere_module_xyz:f")
    for timeout in (float("nan"), float("inf"), 0.0, -1.0):
        with pytest.raises(ValueError, match="timeout"):
            Scorer("arithmetic", timeout_s=timeout)


def test_a_prompt_too_deep_to_send_gets_a_plain_verdict_not_a_restart():
    """Round 3: a prompt whose answer nests beyond what pickle can copy (a task that did not
    check it) gets its verdict; the scorer process is not restarted."""
    deep = 7
    for _ in range(5000):
        deep = [deep]
    scorer = Scorer("arithmetic", {"digits": 2})
    (scored,) = scorer.score_groups([group(Prompt("deep", "1+1=", deep), "2")])
    restarts = scorer.pool.restarts
    scorer.close()
    (verdict,) = scored.verdicts
    assert (verdict.reward, verdict.error) == (0.0, None)
    assert verdict.reason == "the prompt cannot be sent to the scorer (RecursionError)"
    assert restarts == 0
