"""The Scorer: task verifier or plugin per response, and the error/timeout counters."""

import time

import pytest

from groupflow.records import Prompt, Response, SampledGroup
from groupflow.reward_workers.scorer import Scorer
from groupflow.reward_workers.tasks import math_answer


def group(prompt, *texts):
    responses = [Response(token_ids=[1], text=t, logprobs=[-0.1]) for t in texts]
    return SampledGroup(prompt=prompt, prompt_ids=[0], responses=responses, policy_version=3)


def test_scores_a_group_with_the_task_verifier():
    scorer = Scorer("arithmetic", {"digits": 2})
    sampled = group(Prompt("37+45", "37+45=", 82), "82", "81", "")
    scored = scorer.score_group(sampled)
    assert scored.group is sampled
    assert scored.rewards == [1.0, 0.0, 0.0]
    assert (scorer.errors, scorer.timeouts) == (0, 0)


def test_a_plugin_replaces_the_verifier_and_failures_are_counted(tmp_path):
    path = tmp_path / "plugin.py"
    path.write_text(
        "import time\n"
        "def reward(prompt, response, answer):\n"
        "    if response == 'hang':\n"
        "        time.sleep(1.0)\n"
        "    if response == 'boom':\n"
        "        raise RuntimeError('boom')\n"
        "    return float(response == 'yes')\n"
    )
    scorer = Scorer("arithmetic", plugin=f"{path}:reward", timeout_s=0.2)
    start = time.monotonic()
    scored = scorer.score_group(group(Prompt("1+1", "1+1=", 2), "yes", "2", "boom", "hang", "hang"))
    assert time.monotonic() - start < 1.5
    assert scored.rewards == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert [v.error for v in scored.verdicts] == [None, None, "error", "timeout", "timeout"]
    assert (scorer.errors, scorer.timeouts) == (1, 2)


def test_a_verifier_that_raises_costs_one_sample(monkeypatch, caplog):
    scorer = Scorer("arithmetic")

    def broken(prompt, response):
        raise IndexError("verifier bug")

    monkeypatch.setattr(scorer.task, "verify", broken)
    scored = scorer.score_group(group(Prompt("1+1", "1+1=", 2), "2", "2"))
    assert scored.rewards == [0.0, 0.0]
    assert "IndexError: verifier bug" in scored.verdicts[0].reason
    assert scorer.errors == 2
    assert len([r for r in caplog.records if "verifier bug" in r.getMessage()]) == 1


def test_verifier_timeouts_are_counted(monkeypatch):
    monkeypatch.setattr(math_answer, "_compare", lambda gold, candidate: time.sleep(0.5))
    scorer = Scorer("math", {"timeout_s": 0.05})
    scored = scorer.score_group(group(Prompt("m", "?", "1"), "\\boxed{1}", "no answer here"))
    assert [v.error for v in scored.verdicts] == ["timeout", None]
    assert (scorer.errors, scorer.timeouts) == (0, 1)


def test_bad_configuration_fails_at_construction():
    with pytest.raises(ValueError, match="unknown task"):
        Scorer("chess")
    with pytest.raises(ValueError, match="reward plugin"):
        Scorer("arithmetic", plugin="nowhere_module_xyz:f")
