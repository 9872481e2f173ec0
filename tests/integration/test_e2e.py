"""End to end through the CLI entry point, on the shared local Ray cluster."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from groupflow.learner.lr_schedule import lr_at
from groupflow.observe.catalogue import BY_KEY
from groupflow.run.cli import main
from groupflow.run.job_config import load_config
from tests.hf_cache import cache_model, read_offline
from tests.integration.test_presets import DIAGNOSTICS

pytestmark = pytest.mark.integration

STEP_KEYS = {
    "step",
    "policy_version",
    "reward_mean",
    "reward_std",
    "response_len_mean",
    "entropy_mean",
    "clip_frac",
    "grad_norm",
    "tokens_generated",
    "time_gen_s",
    "time_reward_s",
    "time_learn_s",
    "time_sync_s",
    "time_step_s",
    "staleness_mean",
    "weight_sync_verified",
}


def test_three_steps_with_overlap_write_the_run_directory(
    ray_cluster, quickstart_model, tmp_path, monkeypatch
):
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "plugins"))  # the driver's path
    # The model is named by a hub id, from a Hugging Face cache read offline: the driver
    # resolves it once, and the engines and ranks load the snapshot.
    hf_home = tmp_path / "hf"
    read_offline(monkeypatch, hf_home)
    cache_model(hf_home, "groupflow/quickstart", Path(quickstart_model))
    code = main(
        [
            "train",
            "--set",
            f"trainer.output_dir={tmp_path}",
            "--set",
            "trainer.run_name=e2e",
            "--set",
            "trainer.steps=3",
            "--set",
            "trainer.max_staleness=1",
            "--set",
            "task.eval_size=32",
            "--set",
            "learner.optimizer.lr=1e-3",
            # issue 13's options ride along on this run: a schedule, a tracker, sample logs
            "--set",
            "learner.optimizer.lr_schedule=cosine",
            "--set",
            "learner.optimizer.warmup_steps=2",
            "--set",
            "metrics.loggers=[tensorboard]",
            "--set",
            "trainer.log_samples_every=2",
            "--set",
            "trainer.eval_every=2",
            "--set",
            "task.eval_sets=[{name: long, task: arithmetic, options: {terms: 4}, size: 8}]",
            # the grpo preset's riders (tests/integration/test_presets.py): sampled evaluation,
            # and kl.coef > 0, which loads the frozen reference on every rank, and the entropy
            # bonus, which backpropagates
            "--set",
            "trainer.eval_samples=2",
            "--set",
            "trainer.eval_pass_k=2",
            "--set",
            "algorithm.kl.coef=0.05",
            "--set",
            "algorithm.kl.estimator=k3",
            "--set",
            "algorithm.entropy_coef=0.01",
            # issue 42's rider: the quickstart's two ranks as one sequence-parallel group
            # (Ulysses attention in the real ZeRO-3 forward and backward, the reference's
            # forward too); its step is checked against one rank in float64 in
            # tests/unit/test_sequence_parallel.py
            "--set",
            "learner.sequence_parallel_size=2",
            # half the quickstart's prompts a step: the two ranks are one sequence-parallel
            # group, so each learns every sequence (half of each), and the quickstart's short
            # sequences make that step four times as long as a data-parallel one
            "--set",
            "rollout.prompts_per_step=16",
            "--set",
            "model.path=groupflow/quickstart",
            # issue 41's rider: a verifiers taskset (tests/integration/plugins/sums_taskset.py,
            # on the cluster's path by tests/conftest.py) trains beside arithmetic, scored by
            # its own reward in the reward workers' scorer processes
            "--set",
            "task.name=mixture",
            "--set",
            "task.options={tasks: [{name: arithmetic, weight: 3}, "
            "{name: 'verifiers:sums_taskset', weight: 1}]}",
            # a scorer process a reward worker: each one imports verifiers (~10 s of CPU)
            "--set",
            "reward.scorer_processes=1",
        ]
    )
    assert code == 0
    run = tmp_path / "e2e"
    assert (run / "config.resolved.yaml").is_file()
    assert load_config(run / "config.resolved.yaml").model.path == "groupflow/quickstart"
    # what resolve decided at max_staleness 1 heads the file (docs/config.md, "Resolved")
    resolved = (run / "config.resolved.yaml").read_text()
    assert "\n#   rollout.partial_rollout: true (unset: " in resolved
    assert '\n#   algorithm.off_policy.mode: "tis" (unset: ' in resolved
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert STEP_KEYS <= r.keys(), STEP_KEYS - r.keys()
        # every key the job writes is documented in the metric catalogue
        assert r.keys() <= BY_KEY.keys(), r.keys() - BY_KEY.keys()
        assert DIAGNOSTICS <= r.keys(), DIAGNOSTICS - r.keys()
        assert r["optimizer_updates"] == 1
        assert 0 <= r["groups_with_spread"] <= r["num_groups"]
        # the largest rank's peak resident memory over the step, and what a rank may use
        assert 0 < r["actor_memory_bytes"]["learner"] < r["actor_memory_limit_bytes"]["learner"]
    # one update a step: step 1 trains at the reference, later steps away from it
    assert records[0]["kl_ref"] == 0.0 and all(r["kl_ref"] > 0.0 for r in records[1:])
    assert 0.0 <= records[1]["eval_mean_at_n"] <= records[1]["eval_pass_at_k"] <= 1.0  # k = n
    # every engine load that finished was checked against the learner's checksums (the
    # engine's load of version 1 ran before it sampled step 3's groups)
    assert sum(r["weight_sync_verified"] for r in records) >= 1
    # generation of step k+1 ran on version k-1 weights while step k trained: exactly one behind
    assert [r["staleness_max"] for r in records] == [0, 1, 1]
    cfg = load_config(run / "config.resolved.yaml")
    assert [r["lr"] for r in records] == pytest.approx(
        [lr_at(cfg.learner.optimizer, r["step"], 3) for r in records], rel=1e-12
    )
    assert records[0]["lr"] == pytest.approx(0.5e-3)  # half-way through the warmup
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward_mean")] == [1, 2, 3]
    assert list(run.glob("samples/*.jsonl")) == [run / "samples" / "step_2.jsonl"]
    samples = [json.loads(line) for line in (run / "samples/step_2.jsonl").read_text().splitlines()]
    assert len(samples) == cfg.rollout.prompts_per_step * cfg.rollout.group_size
    keys = {"prompt", "response", "reward", "reason", "advantage", "finish_reason"}
    assert keys <= samples[0].keys()
    assert all(row["prompt"].endswith("=") for row in samples)  # the quickstart's raw prompts
    # step 2 evaluated the job's held-out set and the extra one, by name
    assert 0.0 <= records[1]["eval_accuracy"] <= 1.0
    assert list(records[1]["eval_set_accuracy"]) == ["long"]
    summary = json.loads((run / "summary.json").read_text())
    assert list(summary["final_eval"]["eval_set_accuracy"]) == ["long"]
    assert {"warm_start_accuracy", "final_accuracy"} <= summary.keys()
    assert cfg.learner.sequence_parallel_size == 2
    # the end line of a run that had nothing to learn from, exactly when no step had a spread
    assert (summary["nothing_learned"] is None) == any(r["groups_with_spread"] for r in records)
    assert summary["prompts_left_out"] == {
        "task arithmetic": 0,
        "task verifiers:sums_taskset": 0,
        "task.eval_sets long": 0,
    }
    # the verifiers taskset trained in every step, scored by its reward (0 or 1 a sample), and
    # was evaluated on its own held-out tasks
    tasks = ["arithmetic", "verifiers:sums_taskset"]
    for r in records:
        assert sorted(r["task_reward_mean"]) == tasks
        assert 0.0 <= r["task_reward_mean"]["verifiers:sums_taskset"] <= 1.0
    assert sorted(records[1]["eval_task_accuracy"]) == tasks
    # the driver's story in the run directory (issue 37), from the run's start (held until the
    # directory existed) to its end, with a line a step: its elapsed time and ETA
    driver_log = (run / "driver.log").read_text().splitlines()
    step_lines = [
        line.split(": ", 1)[1] for line in driver_log if "groupflow.run_log: step " in line
    ]
    assert [line.split(" reward=")[0] for line in step_lines] == [
        "step 1/3",
        "step 2/3",
        "step 3/3",
    ]
    assert all(" elapsed=" in line and " eta=" in line for line in step_lines)
    assert step_lines[-1].endswith(" eta=0:00")
    for said in ("driver started", "actors up in", "held-out greedy accuracy after training"):
        assert any(said in line for line in driver_log), said
    # the tiny model's share fits one micro-batch: learner.gradient_checkpointing: auto is off
    assert any(
        re.search(
            r"learner: gradient checkpointing off \(auto: a rank's share of a mini-batch, "
            r"[\d,]+ positions, fits one micro-batch without it",
            line,
        )
        for line in driver_log
    ), driver_log

    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(run / "model").state_dict()
    initial = AutoModelForCausalLM.from_pretrained(quickstart_model).state_dict()
    assert trained.keys() == initial.keys()
    assert any(not torch.equal(trained[k], initial[k]) for k in initial)


@pytest.mark.parametrize(
    "args, culprit",
    [
        (["--set", "rollout.group_sise=4"], "rollout.group_sise"),
        (["--set", "model.path=/nonexistent/model"], "model.path"),
        (["/nonexistent/job.yaml"], "/nonexistent/job.yaml"),
        (["--set", "rollout.sampling.top_k=-1"], "rollout.sampling.top_k"),
        (["--set", "reward.overlong_penalty.buffer_tokens=16"], "buffer_tokens"),
        (["--set", "metrics.loggers=[mlflow]"], "metrics.loggers"),
        (["--set", "task.chat_template=/nonexistent/chat.jinja"], "task.chat_template"),
        (["--set", "task.system_prompt=be brief"], "task.system_prompt"),
        (["--set", "learner.optimizer.lr_schedule=step"], "learner.optimizer.lr_schedule"),
        (["--set", "trainer.eval_pass_k=4"], "eval_pass_k"),
        (["--set", "task=[{name: arithmetic, weight: -1}]"], "task: arithmetic: weight"),
        (["--set", "task.eval_sets=[{name: x, task: nope}]"], "task.eval_sets.0"),
        (["--set", "agent.tools=[calculater]"], "agent.tools"),
        (["--set", "agent.tools=[calculator]"], "needs a chat template"),
        (
            # the tests' tool model (tests/conftest.py TOOL_MODEL_WARM_START)
            ["--set", "task.name=tool_arithmetic", "--set", "model.warm_start_steps=30"]
            + ["--set", "agent.tool_parser=nope"],
            "agent.tool_parser",
        ),
        (["--set", "agent.tools=[no_such_module:tool]"], "agent.tools"),
    ],
)
def test_bad_input_exits_nonzero_with_one_line(args, culprit, tmp_path, capsys):
    # In this process (the CLI's own entry point): every check runs before a cluster is joined.
    code = main(["train", *args, "--set", f"trainer.output_dir={tmp_path}"])
    assert code != 0
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and culprit in lines[0], err
