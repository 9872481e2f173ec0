"""Scaling a running job on the real stack (the shared local Ray cluster, vLLM engines,
DeepSpeed ranks): one training run, its own driver process, with room for two engines. The job
is the quickstart trained with LoRA adapters (issue 28), so that the same job also shows that
LoRA learns and what it saves: one job start for both.

The job starts with one engine and `rollout.autoscale: {min_engines: 1, max_engines: 2}`; the
quickstart with one engine and one learner rank is generation-bound (strictly on-policy: the
learner waits for every rollout, about half of each step), so autoscaling asks for a second
engine within a bounded number of steps, and once it serves steps, `groupflow scale RUN
--engines 1` takes the job back to one engine while it trains. The run then trains to its end
with one engine. (A run whose driver was killed, `failed` in `groupflow status` and refused by
`groupflow scale`, is tests/unit/test_run_target.py's and test_scaling.py's.)"""

from __future__ import annotations

import json
import re
import statistics

import pytest

from groupflow.core.adapters import MERGED_DIR
from groupflow.run.cli import main
from tests.integration.driver_process import DriverProcess, run_records
from tests.integration.ray_nodes import free_port

pytestmark = pytest.mark.integration

# Rank-16 adapters at lr 1e-3 (ten times the whole model's) for 20 steps: 0.330 to 0.602 when
# measured (docs/lora.md). 20 steps also leave room for the engine's start (about 25 s) and
# the scale-down between the autoscale's request and the end.
STEPS = 20
PATIENCE = 2
TRAIN = [
    "--set",
    "trainer.run_name=scale",
    "--set",
    f"trainer.steps={STEPS}",
    "--set",
    "metrics.progress=false",
    "--set",
    "learner.lora.rank=16",
    "--set",
    "learner.optimizer.lr=1e-3",
    "--set",
    "trainer.checkpoint_every=10",
    "--set",
    f"trainer.save_hf_every={STEPS}",
    "--set",
    "trainer.save_merged=true",
    "--set",  # one rank learns what two do (test_lora's stack trains adapters on two)
    "learner.num_ranks=1",
    "--set",
    "rollout.num_engines=1",
    # 8 CPUs: the rank takes 0.5, the reward workers 0.5; two engines of 3 fit, a third not
    "--set",
    "rollout.resources.num_cpus=3",
    "--set",
    f"rollout.autoscale={{min_engines: 1, max_engines: 2, patience: {PATIENCE}}}",
]


def test_a_lora_job_learns_while_it_scales_from_one_engine_to_two_and_back(
    ray_cluster, quickstart_model, tmp_path, capsys, monkeypatch
):
    run = tmp_path / "scale"
    driver = DriverProcess(TRAIN, tmp_path)
    runs = ["--runs", str(tmp_path)]
    # A run trained here is found by its run directory: a dashboard URL in RAY_ADDRESS where
    # nothing answers (a user's setting for another cluster) changes nothing.
    monkeypatch.setenv("RAY_ADDRESS", f"http://127.0.0.1:{free_port()}")

    def engines_of_last_step() -> int | None:
        records = run_records(run)
        return records[-1]["num_engines"] if records else None

    try:
        # bad counts are refused before anything is contacted
        assert main(["scale", "scale", *runs, "--engines", "0"]) == 2
        assert main(["scale", "scale", *runs, "--engines", "-2"]) == 2
        driver.wait_for(lambda: engines_of_last_step() == 2)
        assert main(["scale", "scale", *runs, "--engines", "3"]) == 1  # beyond autoscale's max
        assert main(["status", "scale", *runs]) == 0
        assert main(["list", *runs]) == 0
        assert main(["scale", "scale", *runs, "--engines", "1"]) == 0
        down_at = len(run_records(run))
        assert driver.process.wait(timeout=300) == 0, driver.log()[-4000:]
    finally:
        driver.kill()
    # the run has ended: one line, exit 1
    assert main(["scale", "scale", *runs, "--reward-workers", "3"]) == 1
    # its status is read from the run directory, with no cluster
    assert main(["status", str(run)]) == 0
    out, err = capsys.readouterr()
    assert re.search(rf"^scale +running +\d+/{STEPS} +- ", out, re.M), out
    summary = json.loads((run / "summary.json").read_text())
    accuracy = f"{summary['warm_start_accuracy']:.3f} -> {summary['final_accuracy']:.3f}"
    assert f"run scale  finished  step {STEPS}/{STEPS}  held-out accuracy {accuracy}\n" in out
    assert err.splitlines() == [
        "groupflow: error: --engines: a job needs at least one engine (got 0)",
        "groupflow: error: --engines: a count cannot be negative (got -2)",
        "groupflow: error: --engines: 3 is outside rollout.autoscale's bounds [1, 2]",
        f"groupflow: error: run scale is not running (finished; {run})",
    ]
    assert "engines: 2 live, target 2" in out and "learner ranks: 1" in out
    assert "engines: 2 -> 1" in out

    records = run_records(run)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # each step once
    engines = [r["num_engines"] for r in records]
    # 1 ... 1 2 ... 2 1 ...: up once, down once, right after the request
    changes = [i for i in range(1, len(engines)) if engines[i] != engines[i - 1]]
    assert len(changes) == 2 and engines[0] == 1 and engines[-1] == 1, engines
    assert changes[1] <= down_at + 1, (engines, down_at)
    assert all(r["engine_restarts"] == 0 for r in records)
    # the learner waits for generation from the start: autoscale asks within a few steps
    # (its decision is logged with its step)
    log = driver.log()
    (asked,) = re.findall(r"step (\d+): engines target 1 -> 2 \(autoscale\)", log)
    waits = [round(r["time_wait_rollout_s"] / r["time_step_s"], 2) for r in records]
    assert int(asked) <= 2 * PATIENCE + 1, waits
    (join_s,) = re.findall(r"a new engine took its first chunk ([\d.]+)s after", log)

    # LoRA learned, and saved the adapter with the merged model beside it. The gain varies from
    # run to run (which weights sample which chunk depends on timing): 0.09, 0.16 and 0.17
    # measured. Greedy accuracy of unchanged weights is the warm start's exactly, so a gain
    # of 0.05 already says the adapters trained and reached the engines.
    assert summary["final_accuracy"] >= summary["warm_start_accuracy"] + 0.05, summary
    for saved in (run / "model", run / "checkpoints" / f"step_{STEPS}" / "hf"):
        assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {
            p.name for p in saved.iterdir()
        }, saved
        merged = saved / MERGED_DIR
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
            p.name for p in merged.iterdir()
        }, merged
    # the checkpoint holds the adapters, not the model
    learner = run / "checkpoints" / f"step_{STEPS}" / "learner"
    ckpt_bytes = sum(f.stat().st_size for f in learner.rglob("*") if f.is_file())
    merged_bytes = (run / "model" / MERGED_DIR / "model.safetensors").stat().st_size
    assert ckpt_bytes < merged_bytes / 2, (ckpt_bytes, merged_bytes)

    # tokens per second where the learner waited: one engine (but the first, warm-up step)
    # against two; printed, not asserted (the cores are shared)
    with_one = [r["gen_tokens_per_s"] for r in records[1:] if r["num_engines"] == 1]
    with_two = [r["gen_tokens_per_s"] for r in records if r["num_engines"] == 2]
    print(
        f"\nscale-up: first chunk {float(join_s):.1f}s after autoscale asked (step {asked}); "
        f"tokens generated per second, median: one engine {statistics.median(with_one):.0f}, "
        f"two engines {statistics.median(with_two):.0f}; engines per step {engines}; "
        f"learner waiting (share of the step) {waits}; held-out accuracy {accuracy}"
    )
