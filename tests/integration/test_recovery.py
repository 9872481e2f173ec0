"""Checkpoints and recovery on the real stack (the shared local Ray cluster, vLLM engines,
DeepSpeed ZeRO-3 ranks)."""

from __future__ import annotations

import json
import math
import os
import signal
import time

import psutil
import pytest
import ray
import torch

from groupflow.actors.learner import LearnerGroup
from groupflow.core.records import TrainSequence
from groupflow.learner.figures import learner_record
from groupflow.loop.checkpoint import CheckpointStore
from groupflow.run.cli import main
from groupflow.run.job_config import small_model_config
from tests.integration.driver_process import DriverProcess, run_records
from tests.integration.learner_weights import learner_weights

pytestmark = pytest.mark.integration


def _sequences(seed: int, n: int = 8) -> list[TrainSequence]:
    """Fresh random sequences; the learner's own log-probs stand in for vLLM's."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(n):
        ids = torch.randint(3, 70, (12,), generator=g).tolist()  # the model has 75 tokens
        advantage = float(torch.randn((), generator=g, dtype=torch.float64))
        seqs.append(TrainSequence(ids, 4, advantage, i // 2, 0, []))
    return seqs


def _step(learner: LearnerGroup, seed: int) -> dict[str, float]:
    return learner_record(ray.get(learner.async_train_step(_sequences(seed))))


def test_a_learner_checkpoint_restores_weights_and_optimizer_exactly(
    ray_cluster, quickstart_model, tmp_path
):
    """Step A, save, step B; load the save: the weights are A's, and step B again gives B's
    weights bit for bit, so everything step B changed (AdamW's moments and step count too,
    and STAPO's running threshold) came back from the files. (A new process loading a
    checkpoint is the recovery test's.)"""
    stapo = ["algorithm.stapo.enabled=true", "algorithm.stapo.tau_p=auto"]
    cfg = small_model_config({}, ["learner.num_ranks=2", "learner.optimizer.lr=1e-3", *stapo])
    seed = int.from_bytes(os.urandom(2))
    learner = LearnerGroup(cfg, quickstart_model)
    try:
        _step(learner, seed)
        ray.get(learner.async_save_checkpoint(str(tmp_path / "learner")))
        after_a = learner_weights(learner)
        record_b = _step(learner, seed + 1)
        after_b = learner_weights(learner)
        learner.load_checkpoint(str(tmp_path / "learner"))
        loaded = learner_weights(learner)
        record_again_b = _step(learner, seed + 1)
        again_b = learner_weights(learner)
    finally:
        learner.shutdown()
    assert record_again_b["stapo_tau_p"] == record_b["stapo_tau_p"] > 0
    assert any(not torch.equal(after_a[k], after_b[k]) for k in after_a)
    for name, value in after_a.items():
        assert value.dtype == torch.float32 and torch.equal(loaded[name], value), name
        assert torch.equal(again_b[name], after_b[name]), name


TRAIN = [
    "--set",
    "trainer.run_name=recovery",
    "--set",
    "trainer.steps=5",
    "--set",
    "trainer.checkpoint_every=1",
    "--set",
    "trainer.save_hf_every=5",
    "--set",
    "task.eval_size=32",
    "--set",
    "metrics.progress=false",
]


def _our_worker(title: str) -> psutil.Process:
    """The worker of this session's Ray cluster whose process title starts with `title`, once
    there is one (Ray titles a worker `ray::Class` and, while a sync actor runs a method,
    `ray::Class.method`; an async actor's title does not follow its calls)."""
    while True:
        for proc in psutil.Process().children(recursive=True):
            try:
                if proc.cmdline()[:1] and proc.cmdline()[0].startswith(title):
                    return proc
            except psutil.Error:
                continue
        time.sleep(0.05)


def _kill_our_worker(title: str) -> float:
    """SIGKILL the worker titled `title` (see `_our_worker`); when."""
    _our_worker(title).send_signal(signal.SIGKILL)
    return time.monotonic()


def test_a_job_survives_a_dead_engine_a_dead_learner_rank_and_ctrl_c(
    ray_cluster, quickstart_model, tmp_path, capsys
):
    """One job on the shared cluster, its own driver process: an engine is SIGKILLed in the
    middle of step 2's generation, a learner rank in the middle of step 3's learning; the
    driver gets Ctrl-C (SIGINT) once step 3 is recorded, so it stops gracefully after step
    3 (or step 4, if that had begun): it writes the checkpoint, model, plots and
    summary.json (stopped) and says so, with the resume command. `--resume` finishes it;
    a second `--resume` says the run is finished and starts nothing. Every step is in
    metrics.jsonl once and the held-out accuracy is a number."""
    run = tmp_path / "recovery"
    driver = DriverProcess(TRAIN, tmp_path)
    store = CheckpointStore(run)
    try:
        # Step 2's chunks are sent before step 1 learns and wait on the engine for the weights
        # step 1 makes: an engine frozen while step 1 learns holds them, and is killed once
        # step 1's record is out (killed earlier, its death would be step 1's).
        _our_worker("ray::LearnerRankActor.train_step")
        assert not run_records(run), "step 1 was over before its learning was seen"
        engine = _our_worker("ray::Generator")
        engine.send_signal(signal.SIGSTOP)
        driver.wait_for(lambda: [r["step"] for r in run_records(run)] == [1])
        engine.send_signal(signal.SIGKILL)
        engine_killed = time.monotonic()
        driver.wait_for(lambda: len(run_records(run)) == 2)
        engine_back = time.monotonic()
        driver.wait_for(lambda: store.newest() is not None and store.newest().name == "step_2")
        rank_killed = _kill_our_worker("ray::LearnerRankActor.train_step")
        driver.wait_for(lambda: run_records(run)[-1]["learner_restarts"] == 1)
        rank_back = time.monotonic()
        # step 3 is recorded: the stop ends the job after it, or after step 4 if that began
        driver.process.send_signal(signal.SIGINT)
        driver_stopped = time.monotonic()
        assert driver.process.wait(timeout=300) == 0, driver.log()[-4000:]
    finally:
        driver.kill()
    stopped = json.loads((run / "summary.json").read_text())
    reached = stopped["step_reached"]
    assert reached in (3, 4) and (stopped["stopped"], stopped["final_accuracy"]) == (True, None)
    records = run_records(run)
    assert [r["step"] for r in records] == list(range(1, reached + 1))
    assert [r["engine_restarts"] for r in records] == [0, 1, 1, 1][:reached]
    assert [r["learner_restarts"] for r in records] == [0, 0, 1, 1][:reached]
    log = driver.log()
    assert "Ctrl-C: stopping after the step in flight" in log
    for step in range(1, reached + 1):
        saved = f"checkpoint of step {step} saved to {run / 'checkpoints' / f'step_{step}'} in "
        assert saved in log
    (end,) = [line for line in log.splitlines() if line.startswith("stopped at step")]
    assert end.startswith(
        f"stopped at step {reached} of 5 (Ctrl-C): wrote checkpoint "
        f"{run / 'checkpoints' / f'step_{reached}'}, model {run / 'model'}, plots and "
        f"summary.json in {run}; resume with: groupflow train --set trainer.run_name=recovery "
    ), end
    address = ray.get_runtime_context().gcs_address  # DriverProcess joins this cluster
    assert end.endswith(
        f" --set trainer.output_dir={tmp_path} --set cluster.address={address} --resume"
    )
    assert (run / "model" / "config.json").is_file() and (run / "reward.png").is_file()
    assert not (run / "cluster.json").exists()

    resume = ["train", *TRAIN, "--set", f"trainer.output_dir={tmp_path}", "--resume"]
    assert main(resume) == 0
    records = run_records(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [r["policy_version"] for r in records] == [1, 2, 3, 4, 5]
    assert records[-1]["engine_restarts"] == 1 and records[-1]["learner_restarts"] == 1
    summary_text = (run / "summary.json").read_text()
    summary = json.loads(summary_text)
    assert math.isfinite(summary["final_accuracy"]) and summary["resumed_from_step"] == reached
    assert not summary["stopped"] and summary["step_reached"] == 5
    assert [p.name for p in store.complete()] == ["step_4", "step_5"]
    # driver.log holds the stopped driver's lines and the resumed one's after them (issue 37)
    driver_log = (run / "driver.log").read_text().splitlines()
    steps = [
        line.split(": ", 1)[1].split(" ")[1]
        for line in driver_log
        if "groupflow.run_log: step " in line
    ]
    assert steps == [f"{step}/5" for step in range(1, 6)], steps
    assert sum("driver started" in line for line in driver_log) == 2
    assert any(f"resuming after step {reached}" in line for line in driver_log)
    capsys.readouterr()
    assert main(resume) == 0  # finished: nothing to do, nothing started or written
    assert capsys.readouterr().out.startswith("run recovery already finished its 5 steps (")
    assert (run / "summary.json").read_text() == summary_text
    # step 5's Hugging Face copy is the policy the job ended with
    from transformers import AutoModelForCausalLM

    hf = run / "checkpoints" / "step_5" / "hf"
    assert (hf / "tokenizer.json").is_file()  # so that `groupflow eval --model` takes it
    saved = AutoModelForCausalLM.from_pretrained(hf)
    final = AutoModelForCausalLM.from_pretrained(run / "model").state_dict()
    assert all(torch.equal(v, final[k]) for k, v in saved.state_dict().items())
    print(
        f"\nengine killed in step 2: step 2 recorded {engine_back - engine_killed:.1f}s later "
        f"(a normal step: {records[0]['time_step_s']:.1f}s); learner rank killed in step 3: "
        f"step 3 recorded again {rank_back - rank_killed:.1f}s later; driver stopped: the "
        f"resumed job ended {time.monotonic() - driver_stopped:.1f}s later"
    )
