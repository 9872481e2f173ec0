"""A run's checkpoints on disk (groupflow/loop/checkpoint.py): all-or-nothing saves, retention,
the checks before a resume, and metrics.jsonl rewound to the checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum

from groupflow.config import LoraConfig
from groupflow.core.adapters import adapter_shape
from groupflow.core.errors import CheckpointError
from groupflow.core.random_model import random_causal_lm
from groupflow.learner.auto_threshold import (
    NUM_BINS,
    RunningProbabilityThreshold,
    probability_histogram,
)
from groupflow.learner.checkpoint import load_rank_checkpoint, save_rank_checkpoint
from groupflow.loop.checkpoint import LEARNER_DIR, CheckpointStore, Provenance, rewind_metrics
from groupflow.loop.checkpointer import DriverState, Parts, read_checkpoint
from groupflow.loop.prompt_stream import StreamState
from groupflow.run.cli import main
from tests.unit.test_auto_threshold import random_probabilities

F64 = torch.float64
MODEL = {"model_type": "qwen2", "hidden_size": 64, "vocab_size": 100, "_name_or_path": "/a"}


def state(step: int, adapter: dict | None = None) -> DriverState:
    parts = Parts(
        prompt_stream=StreamState(consumed=32 * step),
        restarts={"engine_restarts": 1, "learner_restarts": 0},
        reward_totals={"reward_errors": 1.0, "reward_timeouts": 0.0},
        held_out={"eval_accuracy": 0.25},
    )
    return DriverState(
        step=step,
        policy_version=step,
        provenance=Provenance(model_config_json=MODEL, num_ranks=2, adapter=adapter),
        parts=parts,
    )


# What a rank writes (learner/checkpoint.py), with the structures DeepSpeed's ZeRO-3 save puts
# in its files (runtime/engine.py `_save_checkpoint`, `_save_zero_checkpoint`; stage3.py
# `_rigid_state_dict`), its classes included.
def model_states(rank: int, adapter: dict | None = None) -> dict:
    return dict(
        module=None,
        buffer_names=[],
        optimizer=None,
        param_shapes=[trained_shapes(adapter)],
        frozen_param_shapes=None,
        shared_params={},
        frozen_param_fragments=None,
        lr_scheduler=None,
        data_sampler=None,
        random_ltd=None,
        skipped_steps=0,
        global_steps=3,
        global_samples=96,
        dp_world_size=2,
        mp_world_size=1,
        ds_config={"zero_optimization": {"stage": 3}, "bf16": {"enabled": False}},
        ds_version="0.19.8",
    )


def trained_shapes(adapter: dict | None) -> OrderedDict:
    """The names and shapes of the trained parameters: the whole model's, or with LoRA the
    adapters' as PEFT names them."""
    if adapter is None:
        return OrderedDict([("embed.weight", torch.Size([100, 64]))])
    shapes = OrderedDict()
    for target in adapter["target_modules"]:
        layer = f"base_model.model.model.layers.0.self_attn.{target}"
        shapes[f"{layer}.lora_A.default.weight"] = torch.Size([adapter["rank"], 64])
        shapes[f"{layer}.lora_B.default.weight"] = torch.Size([64, adapter["rank"]])
    return shapes


def optim_states(rank: int, numel: int) -> dict:
    adam = {
        "step": torch.tensor(3.0),
        "exp_avg": torch.randn(numel),
        "exp_avg_sq": torch.rand(numel),
    }
    return dict(
        optimizer_state_dict=dict(
            zero_stage=ZeroStageEnum.weights,
            loss_scaler=LossScaler(1.0),
            dynamic_loss_scale=False,
            overflow=False,
            partition_count=[2],
            optimizer_state_dict={
                "state": {0: adam},
                "param_groups": [{"lr": 1e-5, "betas": (0.9, 0.999), "params": [0]}],
            },
            fp32_flat_groups=[torch.randn(numel)],
        ),
        ds_config={"zero_optimization": {"stage": 3}},
        ds_version="0.19.8",
    )


def running_threshold(seed: int, minibatches: int = 3) -> RunningProbabilityThreshold:
    """STAPO's `tau_p: auto` threshold after a few mini-batches of a peaked policy."""
    gen = torch.Generator().manual_seed(seed)
    threshold = RunningProbabilityThreshold(0.05, decay=0.8)
    for _ in range(minibatches):
        threshold.update(probability_histogram(random_probabilities(gen, 2000)))
    return threshold


def shard_files(rank: int, adapter: dict | None = None) -> dict[str, object]:
    return {
        f"zero/zero_pp_rank_{rank}_mp_rank_00_model_states.pt": model_states(rank, adapter),
        f"zero/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt": optim_states(rank, 25),
        f"rng_rank_{rank}.pt": torch.get_rng_state(),
        f"stapo_threshold_rank_{rank}.pt": running_threshold(rank).state_dict(),
    }


def save(store: CheckpointStore, step: int, keep: int = 5, **changes) -> Path:
    """What a job's save does: the ranks write into the staging dir, the driver commits."""
    staging = store.staging(step)
    (staging / LEARNER_DIR / "zero").mkdir(parents=True)
    for rank in range(2):
        for name, value in shard_files(rank, changes.get("adapter")).items():
            torch.save(value, staging / LEARNER_DIR / name)
    return store.commit(staging, step, state(step, **changes), "trainer: {}\n", keep)


def test_a_commit_makes_the_whole_checkpoint_appear_under_its_step(tmp_path):
    store = CheckpointStore(tmp_path)
    path = save(store, 3)
    assert path == tmp_path / "checkpoints" / "step_3"
    assert sorted(p.name for p in store.root.iterdir()) == ["step_3"]  # no staging left
    loaded = read_checkpoint(path, MODEL, 2)
    assert loaded.model_copy(update={"files": {}}) == state(3)
    assert set(loaded.files) == {
        *(f"learner/{name}" for rank in range(2) for name in shard_files(rank)),
        "config.resolved.yaml",
    }


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
    from groupflow.loop.checkpoint import CheckpointStore
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
    shard = path / LEARNER_DIR / "rng_rank_1.pt"
    shard.write_bytes(shard.read_bytes()[:40])
    message = one_line_error(lambda: read_checkpoint(path, MODEL, 2))
    assert str(shard) in message and "truncated" in message


def test_a_missing_shard_or_state_file_is_refused_naming_it(tmp_path):
    path = save(CheckpointStore(tmp_path), 2)
    (path / LEARNER_DIR / "rng_rank_0.pt").unlink()
    assert "rng_rank_0.pt" in one_line_error(lambda: read_checkpoint(path, MODEL, 2))
    (path / "driver_state.json").unlink()
    assert "driver_state.json" in one_line_error(lambda: read_checkpoint(path, MODEL, 2))


def test_another_model_is_refused_naming_the_key(tmp_path):
    path = save(CheckpointStore(tmp_path), 2)
    other = MODEL | {"hidden_size": 128}
    message = one_line_error(lambda: read_checkpoint(path, other, 2))
    assert message.startswith("model.path:") and "hidden_size" in message
    # where the same model was saved or loaded from does not matter
    assert read_checkpoint(path, MODEL | {"_name_or_path": "/b"}, 2).step == 2


def test_adapters_resume_only_adapters_of_their_shape(tmp_path):
    adapter = adapter_shape(LoraConfig(rank=8, target_modules=["q_proj", "v_proj"]))
    lora = save(CheckpointStore(tmp_path / "lora"), 2, adapter=adapter)
    whole = save(CheckpointStore(tmp_path / "whole"), 2)
    assert read_checkpoint(lora, MODEL, 2, adapter).provenance.adapter == adapter
    assert read_checkpoint(whole, MODEL, 2, None).provenance.adapter is None
    cases = [
        (
            lora,
            None,
            "holds LoRA adapters (rank 8, alpha 32.0, target_modules ['q_proj', "
            "'v_proj']), not a whole model",
        ),
        (whole, adapter, "trained the whole model, not LoRA adapters"),
        (
            lora,
            adapter | {"rank": 16},
            "adapters of another shape (rank: 8 in the checkpoint, 16 now)",
        ),
        (lora, adapter | {"target_modules": "all-linear"}, "target_modules"),
    ]
    for path, now, said in cases:
        message = one_line_error(lambda path=path, now=now: read_checkpoint(path, MODEL, 2, now))
        assert message.startswith("learner.lora: ") and said in message, message


def test_another_number_of_ranks_is_refused_naming_the_key(tmp_path):
    path = save(CheckpointStore(tmp_path), 2)
    assert one_line_error(lambda: read_checkpoint(path, MODEL, 4)).startswith("learner.num_ranks:")


def test_resume_targets(tmp_path):
    resume_target = CheckpointStore(tmp_path).target
    assert resume_target(None) is None
    assert resume_target("never") is None
    assert resume_target("auto") is None  # nothing to resume: a fresh run
    assert "trainer.resume" in one_line_error(lambda: resume_target("latest"))
    save(CheckpointStore(tmp_path), 2)
    newest = save(CheckpointStore(tmp_path), 4)
    assert resume_target("auto") == newest == resume_target("latest")
    older = tmp_path / "checkpoints" / "step_2"
    assert resume_target(str(older)) == older
    assert "trainer.resume" in one_line_error(lambda: resume_target(str(tmp_path / "x")))


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

    from groupflow.run import jobs

    submitted = {}

    class Client:
        def submit_job(self, *, entrypoint, runtime_env, metadata):
            path = Path(runtime_env["working_dir"]) / jobs.JOB_CONFIG_NAME
            submitted.update(yaml.safe_load(path.read_text()))
            return "raysubmit_1"

    monkeypatch.setattr(jobs, "jobs_client", lambda address: Client())
    overrides = [x for o in ("trainer.output_dir=/shared/runs", *set_resume) for x in ("--set", o)]
    assert main(["submit", *overrides, "--no-follow"]) == 0
    assert submitted["trainer"]["resume"] == sent


def test_train_resume_sets_trainer_resume(capsys):
    assert main(["config", "--set", "trainer.resume=auto"]) == 0
    assert "resume: auto" in capsys.readouterr().out
    from groupflow.run.cli import build_parser

    assert build_parser().parse_args(["train", "--resume"]).resume == "latest"
    assert build_parser().parse_args(["train", "j.yaml", "--resume", "/c/step_4"]).resume == (
        "/c/step_4"
    )


# ----- a checkpoint never runs code ------------------------------------------------------------
class RunsCommand:
    """A pickle that runs a shell command when it is loaded."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


class ExecsCode:
    """A pickle that runs Python code when it is loaded."""

    def __init__(self, code: str):
        self.code = code

    def __reduce__(self):
        return exec, (self.code,)


def crafted(kind: str, marker: Path) -> tuple[object, bool]:
    """A hostile payload that writes `marker` if it ever runs, and whether torch.save (zip)
    or plain pickle writes it."""
    payloads = {
        "shell in a zip": (RunsCommand(f"touch {marker}"), True),
        "exec in a zip": (ExecsCode(f"open({str(marker)!r}, 'w').close()"), True),
        "shell in a DeepSpeed dict": (
            optim_states(0, 4) | {"x": RunsCommand(f"touch {marker}")},
            True,
        ),
        "shell in a legacy pickle": (RunsCommand(f"touch {marker}"), False),
    }
    return payloads[kind]


def plant(target: Path, kind: str, marker: Path) -> None:
    payload, zipped = crafted(kind, marker)
    if zipped:
        torch.save(payload, target)
    else:
        import pickle

        target.write_bytes(pickle.dumps(payload))


def rewrite_manifest(checkpoint: Path) -> None:
    """What an attacker with write access does too: record the crafted file's hash."""
    from groupflow.loop.checkpoint import STATE_FILE, _manifest

    state_file = checkpoint / STATE_FILE
    saved = DriverState.model_validate_json(state_file.read_text())
    state_file.write_text(
        saved.model_copy(update={"files": _manifest(checkpoint)}).model_dump_json()
    )


TARGETS = [
    "zero/zero_pp_rank_1_mp_rank_00_model_states.pt",
    "zero/zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "rng_rank_1.pt",
    "stapo_threshold_rank_0.pt",
]
KINDS = ["shell in a zip", "exec in a zip", "shell in a DeepSpeed dict", "shell in a legacy pickle"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("manifest_rewritten", [False, True])
def test_a_crafted_pickle_is_refused_naming_it_and_never_runs(
    tmp_path, target, kind, manifest_rewritten
):
    checkpoint = save(CheckpointStore(tmp_path / "run"), 2)
    marker = tmp_path / "pwned"
    planted = checkpoint / LEARNER_DIR / target
    plant(planted, kind, marker)
    if manifest_rewritten:
        rewrite_manifest(checkpoint)
    message = one_line_error(lambda: read_checkpoint(checkpoint, MODEL, 2))
    assert message.startswith(f"{planted}:")
    # the hash or size catches a file changed alone; the unpickler one with its manifest
    assert ("refused" in message) == manifest_rewritten
    assert not marker.exists()


class RestoringEngine:
    """A DeepSpeed engine's load as it reads files: through its checkpoint engine (runtime/
    engine.py `_load_checkpoint`, `_load_zero_checkpoint`), here DeepSpeed's own
    TorchCheckpointEngine, which unpickles with weights_only=False."""

    def __init__(self):
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import (
            TorchCheckpointEngine,
        )

        self.checkpoint_engine = TorchCheckpointEngine()
        self.loaded = []

    def load_checkpoint(self, directory, tag, **_):
        for f in sorted((Path(directory) / tag).iterdir()):
            self.loaded.append(self.checkpoint_engine.load(str(f), map_location="cpu"))
        return directory, {}


def fresh_threshold() -> RunningProbabilityThreshold:
    return RunningProbabilityThreshold(0.05, decay=0.8)


@pytest.mark.parametrize("target", TARGETS)
def test_a_rank_loads_through_the_restricted_unpickler(tmp_path, target):
    learner = save(CheckpointStore(tmp_path / "run"), 2) / LEARNER_DIR
    engine = RestoringEngine()
    load_rank_checkpoint(engine, str(learner), 1)  # DeepSpeed's classes are let through
    assert engine.loaded[1]["optimizer_state_dict"]["loss_scaler"].cur_scale == 1.0
    marker = tmp_path / "pwned"
    plant(learner / target, "shell in a zip", marker)
    rank = 0 if "rank_0" in target else 1
    message = one_line_error(
        lambda: load_rank_checkpoint(RestoringEngine(), str(learner), rank, fresh_threshold())
    )
    assert message.startswith(f"{learner / target}:") and not marker.exists()
    # the engine's own load is its class's again afterwards
    assert "load" not in vars(engine.checkpoint_engine)


# ----- STAPO's running threshold ----------------------------------------------------------------
class SavingEngine(RestoringEngine):
    """A DeepSpeed engine's save: its shard files under the tag."""

    def save_checkpoint(self, directory, tag, **_):
        (Path(directory) / tag).mkdir(parents=True)
        torch.save(model_states(0), Path(directory) / tag / "model_states.pt")


@pytest.mark.parametrize("seed", range(4))
def test_a_resumed_threshold_is_the_one_the_run_would_have_had(tmp_path, seed):
    """Saved after some mini-batches and loaded into a new rank's empty threshold, the
    threshold sets the same next values as the one saved, exactly, on fresh random inputs."""
    gen = torch.Generator().manual_seed(100 + seed)
    running = running_threshold(seed, minibatches=int(torch.randint(1, 6, (), generator=gen)))
    save_rank_checkpoint(SavingEngine(), str(tmp_path), 0, running)
    resumed, afresh = fresh_threshold(), fresh_threshold()
    assert load_rank_checkpoint(SavingEngine(), str(tmp_path), 0, resumed) is None
    # a policy that sharpened since: a threshold without the history would differ
    for _ in range(3):
        counts = probability_histogram(10 ** (-8 * torch.rand(500, generator=gen, dtype=F64)))
        expected = running.update(counts)
        assert resumed.update(counts) == expected
        assert afresh.update(counts) != expected
    assert torch.equal(resumed.counts, running.counts)


def test_a_checkpoint_without_a_threshold_still_loads_and_says_it_starts_afresh(tmp_path):
    """Checkpoints saved before the threshold was, or by a run with a fixed tau_p."""
    checkpoint = save(CheckpointStore(tmp_path / "run"), 2)
    for rank in range(2):
        (checkpoint / LEARNER_DIR / f"stapo_threshold_rank_{rank}.pt").unlink()
    rewrite_manifest(checkpoint)
    assert read_checkpoint(checkpoint, MODEL, 2).step == 2
    threshold = fresh_threshold()
    note = load_rank_checkpoint(RestoringEngine(), str(checkpoint / LEARNER_DIR), 1, threshold)
    assert "\n" not in note and "starts afresh" in note and "stapo.tau_p" in note
    assert threshold.counts.sum() == 0
    # and a run with a fixed tau_p loads one that has it, with nothing to say
    assert load_rank_checkpoint(RestoringEngine(), str(checkpoint / LEARNER_DIR), 1) is None


def test_a_threshold_counted_in_other_bins_starts_afresh(tmp_path):
    state = running_threshold(0).state_dict()
    state["binning"] = torch.tensor([-30.0, 10.0], dtype=F64)
    save_rank_checkpoint(SavingEngine(), str(tmp_path), 0)
    torch.save(state, tmp_path / "stapo_threshold_rank_0.pt")
    threshold = fresh_threshold()
    note = load_rank_checkpoint(SavingEngine(), str(tmp_path), 0, threshold)
    assert "other bins" in note and threshold.counts.sum() == 0


@pytest.mark.parametrize(
    "bad",
    [
        {"counts": -torch.ones(NUM_BINS, dtype=F64)},
        {"counts": torch.full((NUM_BINS,), float("nan"), dtype=F64)},
        {"counts": torch.ones(7, dtype=F64)},
        {"counts": torch.ones(NUM_BINS, dtype=torch.float32)},
        {"counts": [1.0] * NUM_BINS},
        {"binning": None},
    ],
)
def test_a_threshold_no_histogram_could_hold_is_refused_naming_the_file(tmp_path, bad):
    state = running_threshold(0).state_dict() | bad
    save_rank_checkpoint(SavingEngine(), str(tmp_path), 0)
    path = tmp_path / "stapo_threshold_rank_0.pt"
    torch.save(state, path)
    message = one_line_error(
        lambda: load_rank_checkpoint(SavingEngine(), str(tmp_path), 0, fresh_threshold())
    )
    assert message.startswith(f"{path}: not a running threshold")


# ----- every file as it was saved ---------------------------------------------------------------
def test_a_changed_added_or_symlinked_file_is_refused_naming_it(tmp_path):
    path = save(CheckpointStore(tmp_path / "run"), 2)
    rng = path / LEARNER_DIR / "rng_rank_0.pt"
    data = bytearray(rng.read_bytes())
    data[-30] ^= 1  # same size, other content
    rng.write_bytes(bytes(data))
    message = one_line_error(lambda: read_checkpoint(path, MODEL, 2))
    assert message.startswith(f"{rng}:") and "SHA-256" in message
    rng.write_bytes(bytes(data[:-30]) + bytes([data[-30] ^ 1]) + bytes(data[-29:]))
    assert read_checkpoint(path, MODEL, 2).step == 2
    extra = path / LEARNER_DIR / "zero" / "extra.pt"
    extra.write_bytes(b"x")
    assert one_line_error(lambda: read_checkpoint(path, MODEL, 2)).startswith(f"{extra}:")
    extra.unlink()
    outside = tmp_path / "outside.pt"
    rng.rename(outside)
    rng.symlink_to(outside)
    assert one_line_error(lambda: read_checkpoint(path, MODEL, 2)).startswith(f"{rng}:")


def merged(saved: dict, changes: dict) -> dict:
    """`saved` with `changes` written over it, key by key into nested dicts."""
    out = dict(saved)
    for key, value in changes.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict) and value
        out[key] = merged(out[key], value) if both else value
    return out


@pytest.mark.parametrize(
    "changes",
    [
        {"step": -1},
        {"policy_version": -3},
        {"parts": {"prompt_stream": {"consumed": -32}}},
        {"provenance": {"num_ranks": 0}},
        {"parts": {"held_out": {"eval_accuracy": float("nan")}}},
        {"parts": {"reward_totals": {"reward_errors": float("inf")}}},
        {"parts": {"restarts": {"engine_restarts": 1.5}}},
        {"parts": {"surprise": {}}},
        {"files": {"../../escape.pt": {"size": 1, "sha256": "0" * 64}}},
        {"files": {"/etc/passwd": {"size": 1, "sha256": "0" * 64}}},
        {"files": {"learner/rng_rank_0.pt": 5}},  # a manifest of sizes only
        {"surprise": 1},
        {"format": 3},  # a newer groupflow's
    ],
)
def test_a_hostile_driver_state_is_refused_naming_the_state_file(tmp_path, changes):
    path = save(CheckpointStore(tmp_path / "run"), 2)
    state_file = path / "driver_state.json"
    saved = json.loads(state_file.read_text())
    state_file.write_text(json.dumps(merged(saved, changes)))
    assert one_line_error(lambda: read_checkpoint(path, MODEL, 2)).startswith(f"{state_file}:")


# ----- a full disk, and pruning -----------------------------------------------------------------
def test_a_commit_on_a_full_disk_is_one_line_and_leaves_the_previous_checkpoint_newest(tmp_path):
    store = CheckpointStore(tmp_path)
    save(store, 2)
    staging = store.staging(4)
    (staging / "config.resolved.yaml").symlink_to("/dev/full")  # every write: ENOSPC
    message = one_line_error(lambda: store.commit(staging, 4, state(4), "trainer: {}\n", 5))
    assert message.startswith(f"{staging}:") and "No space left on device" in message
    assert [p.name for p in store.root.iterdir()] == ["step_2"]  # staging cleared
    assert read_checkpoint(store.newest(), MODEL, 2).step == 2


class FillingEngine:
    """A DeepSpeed engine whose save meets a full disk."""

    def save_checkpoint(self, directory, tag, **_):
        (Path(directory) / tag).mkdir(parents=True)
        (Path(directory) / tag / "shard.pt").symlink_to("/dev/full")
        with (Path(directory) / tag / "shard.pt").open("wb") as f:
            f.write(b"x" * 8192)


def test_a_ranks_save_on_a_full_disk_is_one_line_naming_the_directory(tmp_path):
    from groupflow.learner.checkpoint import save_rank_checkpoint

    message = one_line_error(lambda: save_rank_checkpoint(FillingEngine(), str(tmp_path), 0))
    assert message.startswith(f"{tmp_path}:") and "No space left on device" in message


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs: a disk that really fills (mounting needs root, as in CI)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)


def test_a_hugging_face_save_on_a_full_disk_is_one_line_naming_the_directory(small_disk):
    """safetensors reports a full disk as an error of its own, not an OSError."""
    from groupflow.learner.checkpoint import saving_to

    # about 0.5 MB of weights on a 64 KiB disk
    model = random_causal_lm(64, hidden_size=128, intermediate_size=256, num_hidden_layers=1)
    target = small_disk / "hf"

    def save():
        with saving_to(str(target)):
            model.save_pretrained(target)

    message = one_line_error(save)
    assert message.startswith(f"{target}:") and "no space left" in message


def test_pruning_follows_no_symlink(tmp_path):
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "data").write_text("keep me")
    store = CheckpointStore(tmp_path / "run")
    save(store, 2)
    (store.root / "step_1").symlink_to(outside)  # older than every checkpoint
    (store.root / ".staging-step_0").symlink_to(outside)
    final = save(store, 4, keep=1)
    assert (outside / "data").read_text() == "keep me"
    assert [p.name for p in store.complete()] == ["step_4"]  # a symlink is no checkpoint
    assert read_checkpoint(final, MODEL, 2).step == 4


def test_a_failed_pruning_is_logged_and_the_save_stands(tmp_path, monkeypatch, caplog):
    store = CheckpointStore(tmp_path)
    save(store, 2)

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr("groupflow.loop.checkpoint.shutil.rmtree", refuse)
    final = save(store, 4, keep=1)
    assert read_checkpoint(final, MODEL, 2).step == 4
    assert "step_2" in caplog.text and "Permission denied" in caplog.text


# ----- the adapter record against the saved tensors ---------------------------------------------
LORA_RECORD = adapter_shape(LoraConfig(rank=8, target_modules=["q_proj", "v_proj"]))


def _edit_record(path: Path, adapter) -> None:
    """The driver state's adapter record rewritten: the state file is outside the manifest."""
    state_file = path / "driver_state.json"
    saved = json.loads(state_file.read_text())
    saved["provenance"]["adapter"] = adapter
    state_file.write_text(json.dumps(saved))


def _rewrite_shard(path: Path, name: str, value) -> None:
    """A learner file replaced, its manifest entry with it (whoever can do the one can do the
    other)."""
    import hashlib

    torch.save(value, path / LEARNER_DIR / name)
    data = (path / LEARNER_DIR / name).read_bytes()
    state_file = path / "driver_state.json"
    saved = json.loads(state_file.read_text())
    saved["files"][f"{LEARNER_DIR}/{name}"] = {
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    state_file.write_text(json.dumps(saved))


STATES_0 = "zero/zero_pp_rank_0_mp_rank_00_model_states.pt"


@pytest.mark.parametrize(
    "record, said",
    [
        (
            LORA_RECORD | {"rank": 16},
            "provenance.adapter.rank is 16, but {states} holds "
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight of shape "
            "[8, 64]",
        ),
        (
            LORA_RECORD | {"target_modules": ["q_proj"]},
            "provenance.adapter.target_modules ['q_proj'] does not name "
            "base_model.model.model.layers.0.self_attn.v_proj",
        ),
        (None, "provenance.adapter is null (the whole model), but {states} holds LoRA matrices"),
    ],
)
def test_an_edited_adapter_record_is_refused_against_the_saved_tensors(tmp_path, record, said):
    """The record matched the config, so the start check passed, and every rank's load failed
    with a traceback after every actor started (issue 39)."""
    path = save(CheckpointStore(tmp_path), 2, adapter=LORA_RECORD)
    _edit_record(path, record)
    message = one_line_error(lambda: read_checkpoint(path, MODEL, 2, record))
    states = path / LEARNER_DIR / STATES_0
    assert message.startswith(f"{path / 'driver_state.json'}: ")
    assert said.format(states=states) in message, message


def test_a_whole_model_record_over_adapter_tensors_and_the_reverse_are_refused(tmp_path):
    whole = save(CheckpointStore(tmp_path / "whole"), 2)
    _edit_record(whole, LORA_RECORD)
    message = one_line_error(lambda: read_checkpoint(whole, MODEL, 2, LORA_RECORD))
    assert "records LoRA adapters, but" in message and "holds embed.weight, not a LoRA" in message


def test_an_adapter_checkpoint_with_a_lone_matrix_or_nan_weights_is_refused(tmp_path):
    path = save(CheckpointStore(tmp_path), 2, adapter=LORA_RECORD)
    shapes = trained_shapes(LORA_RECORD)
    shapes.pop("base_model.model.model.layers.0.self_attn.v_proj.lora_B.default.weight")
    _rewrite_shard(path, STATES_0, model_states(0) | {"param_shapes": [shapes]})
    message = one_line_error(lambda: read_checkpoint(path, MODEL, 2, LORA_RECORD))
    assert message.endswith("layers.0.self_attn.v_proj.lora_A has no lora_B"), message

    path = save(CheckpointStore(tmp_path / "nan"), 2, adapter=LORA_RECORD)
    optim = optim_states(1, 25)
    optim["optimizer_state_dict"]["fp32_flat_groups"] = [torch.full((25,), float("nan"))]
    _rewrite_shard(path, "zero/zero_pp_rank_1_mp_rank_00_optim_states.pt", optim)
    message = one_line_error(lambda: read_checkpoint(path, MODEL, 2, LORA_RECORD))
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt: the adapters' weights hold NaN" in message


@pytest.mark.parametrize("stray", ["file", "symlink", "zero-padded", "moved"])
def test_a_stray_step_entry_among_the_checkpoints_is_refused_in_one_line(tmp_path, stray):
    """Round 3: a stray step file among the checkpoints passed every check."""
    from groupflow.loop.checkpointer import find_resume

    store = CheckpointStore(tmp_path)
    save(store, 2)
    newest = save(store, 4)
    entry = store.root / "step_7"
    if stray == "file":
        entry.write_text("stray")
    elif stray == "symlink":
        entry.symlink_to(newest)
    elif stray == "zero-padded":
        entry = store.root / "step_007"
        entry.mkdir()
    else:  # a checkpoint under another step's name
        entry = newest.rename(store.root / "step_9")
    message = one_line_error(lambda: find_resume("auto", store))
    assert str(entry) in message and "\n" not in message
