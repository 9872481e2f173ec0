"""A run's checkpoints on disk (groupflow/checkpoint.py): all-or-nothing saves, retention,
the checks before a resume, and metrics.jsonl rewound to the checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from groupflow.checkpoint import (
    LEARNER_DIR,
    CheckpointError,
    CheckpointStore,
    DriverState,
    read_checkpoint,
    resume_target,
    rewind_metrics,
)
from groupflow.cli import main

MODEL = {"model_type": "qwen2", "hidden_size": 64, "vocab_size": 100, "_name_or_path": "/a"}


def state(step: int, **changes) -> DriverState:
    fields = dict(
        step=step,
        policy_version=step,
        prompts_consumed=32 * step,
        warm_start_accuracy=0.25,
        counters={"reward_errors": 1.0},
        model_config_json=MODEL,
        num_ranks=2,
    )
    return DriverState(**(fields | changes))


def save(store: CheckpointStore, step: int, keep: int = 5, shard_bytes: int = 100) -> Path:
    """What a job's save does: the ranks write into the staging dir, the driver commits."""
    staging = store.staging(step)
    (staging / LEARNER_DIR).mkdir()
    for rank in range(2):
        (staging / LEARNER_DIR / f"shard_{rank}.pt").write_bytes(os.urandom(shard_bytes))
    return store.commit(staging, state(step), "trainer: {}\n", keep)


def test_a_commit_makes_the_whole_checkpoint_appear_under_its_step(tmp_path):
    store = CheckpointStore(tmp_path)
    path = save(store, 3)
    assert path == tmp_path / "checkpoints" / "step_3"
    assert sorted(p.name for p in store.root.iterdir()) == ["step_3"]  # no staging left
    loaded = read_checkpoint(path, MODEL, 2)
    assert loaded.model_copy(update={"files": {}}) == state(3)
    assert set(loaded.files) == {"learner/shard_0.pt", "learner/shard_1.pt", "config.resolved.yaml"}


def test_the_newest_k_are_kept(tmp_path):
    store = CheckpointStore(tmp_path)
    for step in (2, 4, 6, 8, 10):
        save(store, step, keep=2)
    assert [p.name for p in store.complete()] == ["step_8", "step_10"]
    assert store.newest().name == "step_10"


def test_steps_are_ordered_as_numbers_and_staging_dirs_are_never_checkpoints(tmp_path):
    store = CheckpointStore(tmp_path)
    save(store, 9)
    save(store, 10)
    store.staging(11)
    assert [p.name for p in store.complete()] == ["step_9", "step_10"]


WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from groupflow.checkpoint import CheckpointStore
    staging = CheckpointStore(Path(sys.argv[1])).staging(int(sys.argv[2]))
    with (staging / "shard.pt").open("wb") as f:
        f.write(b"x" * 4096)
        f.flush()
        print("writing", flush=True)
        time.sleep(600)
    """
)


def test_a_save_killed_half_way_leaves_the_previous_checkpoint_newest_and_loadable(tmp_path):
    store = CheckpointStore(tmp_path)
    save(store, 2)
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path), "4"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout.readline() == "writing\n"
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    assert (store.root / ".staging-step_4" / "shard.pt").is_file()  # the write was under way
    newest = store.newest()
    assert newest.name == "step_2"
    assert read_checkpoint(newest, MODEL, 2).step == 2
    # the next save clears what the killed one left
    save(store, 4)
    assert sorted(p.name for p in store.root.iterdir()) == ["step_2", "step_4"]


# ----- what may resume a job --------------------------------------------------------------------
def one_line_error(fn) -> str:
    with pytest.raises(CheckpointError) as err:
        fn()
    message = str(err.value)
    assert "\n" not in message
    return message


def test_a_truncated_shard_is_refused_naming_the_file(tmp_path):
    path = save(CheckpointStore(tmp_path), 2)
    shard = path / LEARNER_DIR / "shard_1.pt"
    shard.write_bytes(shard.read_bytes()[:40])
    message = one_line_error(lambda: read_checkpoint(path, MODEL, 2))
    assert str(shard) in message and "truncated" in message


def test_a_missing_shard_or_state_file_is_refused_naming_it(tmp_path):
    path = save(CheckpointStore(tmp_path), 2)
    (path / LEARNER_DIR / "shard_0.pt").unlink()
    assert "shard_0.pt" in one_line_error(lambda: read_checkpoint(path, MODEL, 2))
    (path / "driver_state.json").unlink()
    assert "driver_state.json" in one_line_error(lambda: read_checkpoint(path, MODEL, 2))


def test_another_model_is_refused_naming_the_key(tmp_path):
    path = save(CheckpointStore(tmp_path), 2)
    other = MODEL | {"hidden_size": 128}
    message = one_line_error(lambda: read_checkpoint(path, other, 2))
    assert message.startswith("model.path:") and "hidden_size" in message
    # where the same model was saved or loaded from does not matter
    assert read_checkpoint(path, MODEL | {"_name_or_path": "/b"}, 2).step == 2


def test_another_number_of_ranks_is_refused_naming_the_key(tmp_path):
    path = save(CheckpointStore(tmp_path), 2)
    assert one_line_error(lambda: read_checkpoint(path, MODEL, 4)).startswith("learner.num_ranks:")


def test_resume_targets(tmp_path):
    assert resume_target(None, tmp_path) is None
    assert resume_target("never", tmp_path) is None
    assert resume_target("auto", tmp_path) is None  # nothing to resume: a fresh run
    assert "trainer.resume" in one_line_error(lambda: resume_target("latest", tmp_path))
    save(CheckpointStore(tmp_path), 2)
    newest = save(CheckpointStore(tmp_path), 4)
    assert resume_target("auto", tmp_path) == newest == resume_target("latest", tmp_path)
    older = tmp_path / "checkpoints" / "step_2"
    assert resume_target(str(older), tmp_path) == older
    assert "trainer.resume" in one_line_error(lambda: resume_target(str(tmp_path / "x"), tmp_path))


def test_metrics_are_rewound_to_the_checkpoints_step(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "reward_mean": s / 10}) for s in range(1, 6)]
    metrics.write_text("\n".join(lines) + '\n{"step": 6, "rew')  # the crash cut step 6 short
    rewind_metrics(metrics, 3)
    assert metrics.read_text() == "\n".join(lines[:3]) + "\n"


def test_a_refused_resume_is_one_line_and_leaves_the_run_directory_as_it_was(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MODEL | {"hidden_size": 32}))
    run = tmp_path / "runs" / "job"
    checkpoint = save(CheckpointStore(run), 2)
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    code = main(
        [
            "train",
            "--set",
            f"model.path={model}",
            "--set",
            f"trainer.output_dir={tmp_path / 'runs'}",
            "--set",
            "trainer.run_name=job",
            "--resume",
            str(checkpoint),
        ]
    )
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("groupflow: error: model.path:") and "\n" not in err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("set_resume, sent", [((), "auto"), (("trainer.resume=never",), "never")])
def test_a_submitted_job_resumes_by_itself_unless_its_config_says_otherwise(
    monkeypatch, tmp_path, set_resume, sent
):
    import yaml

    from groupflow import jobs

    submitted = {}

    class Client:
        def submit_job(self, *, entrypoint, runtime_env, metadata):
            path = Path(runtime_env["working_dir"]) / jobs.JOB_CONFIG_NAME
            submitted.update(yaml.safe_load(path.read_text()))
            return "raysubmit_1"

    monkeypatch.setattr(jobs, "_client", lambda address: Client())
    overrides = [x for o in ("trainer.output_dir=/shared/runs", *set_resume) for x in ("--set", o)]
    assert main(["submit", *overrides, "--no-follow"]) == 0
    assert submitted["trainer"]["resume"] == sent


def test_train_resume_sets_trainer_resume(capsys):
    assert main(["config", "--set", "trainer.resume=auto"]) == 0
    assert "resume: auto" in capsys.readouterr().out
    from groupflow.cli import build_parser

    assert build_parser().parse_args(["train", "--resume"]).resume == "latest"
    assert build_parser().parse_args(["train", "j.yaml", "--resume", "/c/step_4"]).resume == (
        "/c/step_4"
    )
