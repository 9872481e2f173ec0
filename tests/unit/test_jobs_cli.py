"""`groupflow submit | status | logs | stop`: parsing, local config checks, and what a submission
carries, against a stand-in for the Ray Jobs client (no cluster is contacted here)."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray.job_submission
import yaml
from ray.job_submission import JobStatus

from groupflow.run.cli import main
from groupflow.run.job_config import load_config
from groupflow.run.jobs import (
    ENTRYPOINT,
    JOB_CONFIG_NAME,
    SUBPACKAGES,
    add_job_commands,
    job_runtime_env,
    stage_source,
)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="groupflow")
    add_job_commands(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


class FakeJobClient:
    """Records what a submission sends; plays a job that logs two lines and ends."""

    instances: list[FakeJobClient] = []
    final_status = JobStatus.SUCCEEDED
    info_message = "Job finished successfully."

    def __init__(self, address: str):
        self.address = address
        self.submitted: dict = {}
        self.stopped: list[str] = []
        FakeJobClient.instances.append(self)

    def submit_job(self, *, entrypoint: str, runtime_env: dict, metadata: dict) -> str:
        # The working_dir exists only while submit_job runs (Ray uploads it then): read it now.
        job_yaml = Path(runtime_env["working_dir"]) / JOB_CONFIG_NAME
        self.submitted = {
            "entrypoint": entrypoint,
            "runtime_env": runtime_env,
            "metadata": metadata,
            "config_text": job_yaml.read_text(),
        }
        return "raysubmit_fake"

    async def tail_job_logs(self, job_id: str):
        yield "step 1/2 reward=0.1\n"
        yield "step 2/2 reward=0.2\n"

    def get_job_status(self, job_id: str) -> JobStatus:
        return self.final_status

    def list_jobs(self) -> list[SimpleNamespace]:
        return [
            SimpleNamespace(
                submission_id="raysubmit_fake",
                job_id=None,
                status=self.final_status,
                metadata={"groupflow_run": "unit"},
                start_time=1,
            )
        ]

    def get_job_info(self, job_id: str) -> SimpleNamespace:
        return SimpleNamespace(
            status=self.final_status,
            message=self.info_message,
            metadata={"groupflow_run": "unit"},
        )

    def get_job_logs(self, job_id: str) -> str:
        return "all the logs\n"

    def stop_job(self, job_id: str) -> bool:
        self.stopped.append(job_id)
        return True


@pytest.fixture
def fake_client(monkeypatch):
    FakeJobClient.instances = []
    monkeypatch.setattr(FakeJobClient, "final_status", JobStatus.SUCCEEDED)
    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", FakeJobClient)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return FakeJobClient


@pytest.fixture
def no_cluster(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a cluster was contacted")

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", refuse)


# ----- parsing ------------------------------------------------------------------------------


def test_submit_arguments():
    args = parse(
        [
            "submit",
            "job.yaml",
            "--address",
            "http://10.0.0.1:8265",
            "--set",
            "trainer.steps=2",
            "--set",
            "task.eval_size=16",
            "--no-follow",
        ]
    )
    assert args.command == "submit"
    assert args.config == "job.yaml"
    assert args.overrides == ["trainer.steps=2", "task.eval_size=16"]
    assert args.address == "http://10.0.0.1:8265"
    assert args.no_follow and not args.ship_code


def test_submit_defaults_to_the_quickstart_and_following():
    args = parse(["submit"])
    assert args.config is None and args.overrides == []
    assert args.address is None and not args.no_follow


@pytest.mark.parametrize("command", ["status", "logs", "stop", "scale"])
def test_job_commands_take_a_run_and_an_address(command):
    args = parse([command, "raysubmit_abc", "--address", "http://h:8265", "--runs", "/r"])
    assert (args.command, args.run, args.address, args.runs) == (
        command,
        "raysubmit_abc",
        "http://h:8265",
        "/r",
    )


@pytest.mark.parametrize("command", ["status", "logs", "stop", "scale"])
def test_job_commands_need_a_run(command):
    with pytest.raises(SystemExit):
        parse([command])


# ----- config checked before any cluster is contacted ----------------------------------------


@pytest.mark.parametrize(
    "argv, culprit",
    [
        (["submit", "--set", "rollout.group_sise=4"], "rollout.group_sise: unknown key"),
        (["submit", "--set", "trainer.steps=zero"], "trainer.steps"),
        (["submit", "/no/such/job.yaml"], "/no/such/job.yaml: config file not found"),
    ],
)
def test_a_bad_config_fails_with_one_line_before_any_cluster(no_cluster, capsys, argv, culprit):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("groupflow: error: ")
    assert culprit in err


# ----- what a submission carries -----------------------------------------------------------


def test_submit_carries_the_resolved_config_in_its_working_dir(fake_client, tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text("trainer:\n  steps: 7\n  output_dir: /shared/runs\n  run_name: unit\n")
    assert main(["submit", str(job), "--set", "task.eval_size=16", "--no-follow"]) == 0
    assert capsys.readouterr().out == "raysubmit_fake\n"
    (client,) = fake_client.instances
    sent = client.submitted
    assert sent["entrypoint"] == ENTRYPOINT
    assert ENTRYPOINT.split()[-1] == JOB_CONFIG_NAME
    assert sent["metadata"] == {"groupflow_run": "unit"}
    # a submitted job resumes by itself when resubmitted (trainer.resume unset -> auto)
    assert yaml.safe_load(sent["config_text"]) == yaml.safe_load(
        load_config(job, ["task.eval_size=16", "trainer.resume=auto"]).dump_yaml()
    )
    assert not Path(sent["runtime_env"]["working_dir"]).exists()  # cleaned up after upload
    assert "py_modules" not in sent["runtime_env"]


SHARED = ["--set", "trainer.output_dir=/shared/runs"]


def test_submit_refuses_a_relative_output_dir_with_the_fix(no_cluster, capsys):
    assert main(["submit", "--no-follow"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("groupflow: error: trainer.output_dir: 'runs' is relative")
    assert "--set trainer.output_dir=/shared/runs" in err


def test_submit_sends_relative_input_paths_that_exist_here_as_absolute_ones(
    fake_client, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    for name in ("model", "data", "plugins"):
        (tmp_path / name).mkdir()
    files = ("data/train.jsonl", "data/held.jsonl", "plugins/reward.py", "plugins/agent.py")
    for file in (*files, "chat.jinja"):
        (tmp_path / file).write_text("")
    job = tmp_path / "job.yaml"
    job.write_text(
        "model: {path: model}\n"
        "task:\n"
        "  - {name: math, options: {dataset: data/train.jsonl, eval_dataset: ./data/held.jsonl}}\n"
        "  - {name: arithmetic}\n"
        "reward: {verifier: 'plugins/reward.py:score'}\n"
        "agent: {harness: 'plugins/agent.py:run'}\n"
        "trainer: {output_dir: /shared/runs}\n"
    )
    assert main(["submit", str(job), "--set", "task.chat_template=chat.jinja", "--no-follow"]) == 0
    sent = yaml.safe_load(fake_client.instances[0].submitted["config_text"])
    assert sent["model"]["path"] == str(tmp_path / "model")
    options = sent["task"]["options"]["tasks"][0]["options"]
    assert options["dataset"] == str(tmp_path / "data/train.jsonl")
    assert options["eval_dataset"] == str(tmp_path / "data/held.jsonl")
    assert sent["task"]["chat_template"] == str(tmp_path / "chat.jinja")
    assert sent["reward"]["verifier"] == f"{tmp_path / 'plugins/reward.py'}:score"
    assert sent["agent"]["harness"] == f"{tmp_path / 'plugins/agent.py'}:run"
    (note,) = capsys.readouterr().err.splitlines()
    assert note.startswith("groupflow: note: relative paths sent as absolute ones")
    assert f"task[0].options.dataset={tmp_path / 'data/train.jsonl'}" in note


@pytest.mark.parametrize(
    "override, culprit",
    [
        ("task.options={dataset: data/train.jsonl}", "task.options.dataset: data/train.jsonl"),
        ("model.path=./models/mine", "model.path: ./models/mine"),
        ("task.chat_template=chat.jinja", "task.chat_template: chat.jinja"),
        ("agent.environment=envs/env.py:make", "agent.environment: envs/env.py"),
        ("agent.harness=agents/mine.py:run", "agent.harness: agents/mine.py"),
        ("trainer.resume=runs/x/checkpoints/step_4", "trainer.resume: runs/x/checkpoints/step_4"),
    ],
)
def test_submit_refuses_a_relative_input_path_that_is_not_here(
    no_cluster, tmp_path, monkeypatch, capsys, override, culprit
):
    monkeypatch.chdir(tmp_path)
    name = ["--set", "task.name=math"] if override.startswith("task.options") else []
    assert main(["submit", *SHARED, *name, "--set", override, "--no-follow"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"groupflow: error: {culprit} is relative and not found in {tmp_path}")


def test_submit_leaves_what_may_be_a_hub_id(fake_client, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    hub = ["--set", "model.path=Qwen/Qwen2.5-0.5B-Instruct"]
    assert main(["submit", *SHARED, *hub, "--no-follow"]) == 0
    sent = yaml.safe_load(fake_client.instances[0].submitted["config_text"])
    assert sent["model"]["path"] == "Qwen/Qwen2.5-0.5B-Instruct"


def test_ship_code_uploads_one_groupflow_package(tmp_path):
    code = stage_source(tmp_path / "code")
    env = job_runtime_env(tmp_path / "config", code)
    assert env["working_dir"] == str(tmp_path / "config")
    [shipped] = [Path(d) for d in env["py_modules"]]
    assert shipped.name == "groupflow" and (shipped / "run" / "cli.py").is_file()
    for name in SUBPACKAGES:
        assert (shipped / name / "__init__.py").is_file()
    assert (shipped / "reward_workers" / "tasks" / "__init__.py").is_file()
    assert not list(shipped.rglob("__pycache__"))


def test_without_ship_code_nothing_is_uploaded_but_the_config(tmp_path):
    assert job_runtime_env(tmp_path) == {"working_dir": str(tmp_path)}


def test_address_defaults_to_ray_address(fake_client, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "http://ray-head:8265")
    main(["submit", *SHARED, "--no-follow"])
    assert fake_client.instances[0].address == "http://ray-head:8265"


def test_address_falls_back_to_loopback(fake_client):
    main(["status", "raysubmit_fake"])
    assert fake_client.instances[0].address == "http://127.0.0.1:8265"


# ----- following, status, logs, stop --------------------------------------------------------


@pytest.mark.parametrize(
    "status, code", [(JobStatus.SUCCEEDED, 0), (JobStatus.FAILED, 1), (JobStatus.STOPPED, 1)]
)
def test_follow_prints_the_logs_and_exits_with_the_job(fake_client, capsys, status, code):
    fake_client.final_status = status
    assert main(["submit", *SHARED]) == code
    captured = capsys.readouterr()
    assert captured.out == "raysubmit_fake\nstep 1/2 reward=0.1\nstep 2/2 reward=0.2\n"
    assert f"raysubmit_fake {status.value}" in captured.err


def test_status_shows_the_state_and_the_run(fake_client, capsys):
    assert main(["status", "raysubmit_fake"]) == 0
    assert capsys.readouterr().out == (
        "raysubmit_fake  SUCCEEDED  run=unit\nJob finished successfully.\n"
    )


def test_logs_and_stop(fake_client, capsys):
    assert main(["logs", "raysubmit_fake"]) == 0
    assert capsys.readouterr().out == "all the logs\n"
    assert main(["logs", "raysubmit_fake", "--follow"]) == 0
    assert "step 2/2" in capsys.readouterr().out


def test_stop_of_a_job_without_its_control_actor_goes_through_the_jobs_api(
    fake_client, monkeypatch, capsys
):
    """A submitted job still starting has no control actor for a graceful stop yet: it is
    stopped through the Jobs API at once, saying so."""
    from groupflow.run import live
    from groupflow.run import target as run_target

    running = SimpleNamespace(
        submission_id="raysubmit_fake",
        job_id=None,
        status=JobStatus.RUNNING,
        metadata={"groupflow_run": "unit"},
        start_time=1,
    )
    monkeypatch.setattr(FakeJobClient, "list_jobs", lambda self: [running], raising=False)

    def starting(target):
        raise live.LiveError(f"run {target.run} is not running (no control actor on its cluster)")

    monkeypatch.setattr(run_target, "join_address", lambda address, client: "127.0.0.1:6379")
    monkeypatch.setattr(live, "connect", starting)
    assert main(["stop", "unit", "--runs", "/nonexistent"]) == 0
    assert fake_client.instances[-1].stopped == ["raysubmit_fake"]
    assert capsys.readouterr().out == (
        "run unit is not running (no control actor on its cluster); stopping it at once\n"
        "stopped raysubmit_fake through the Ray Jobs API (SIGTERM, then SIGKILL)\n"
    )


def test_stop_takes_now_and_a_timeout():
    args = parse(["stop", "quickstart", "--now", "--timeout", "30"])
    assert (args.run, args.now, args.timeout) == ("quickstart", True, 30.0)
    assert parse(["stop", "quickstart", "--force"]).now
    assert not parse(["stop", "quickstart"]).now


def test_status_of_a_failed_job_shows_the_error_not_the_whole_log(fake_client, monkeypatch, capsys):
    log_tail = "\n".join(f"log line {i}" for i in range(500))
    message = (
        f"Job entrypoint command failed with exit code 2, last logs:\n{log_tail}\n"
        "groupflow: error: model.path: /x is not a Hugging Face model directory\n"
    )
    monkeypatch.setattr(fake_client, "final_status", JobStatus.FAILED)
    monkeypatch.setattr(fake_client, "info_message", message)
    assert main(["status", "raysubmit_fake"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "raysubmit_fake  FAILED  run=unit",
        "Job entrypoint command failed with exit code 2, last logs:",
        "groupflow: error: model.path: /x is not a Hugging Face model directory",
    ]


def test_a_cluster_with_token_auth_gets_a_hint(monkeypatch, capsys):
    from ray.exceptions import AuthenticationError

    def needs_token(address):
        raise AuthenticationError("Authentication required: Unauthorized")

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", needs_token)
    assert main(["status", "x"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "RAY_AUTH_MODE=token" in err


def test_an_unreachable_cluster_is_one_line_and_exit_1(monkeypatch, capsys):
    def unreachable(address):
        raise ConnectionError(f"Failed to connect to Ray at address: {address}.\nmore detail")

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", unreachable)
    assert main(["status", "x", "--address", "http://127.0.0.1:1"]) == 1
    assert capsys.readouterr().err == (
        "groupflow: error: no run or job named x: no run directory here, and no Ray cluster "
        "answers at http://127.0.0.1:1 (Failed to connect to Ray at address: "
        "http://127.0.0.1:1.); see docs/jobs.md, 'The cluster address'\n"
    )
