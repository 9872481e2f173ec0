"""Discoverable settings: every key described in the schema and in docs/config.md's generated
table, `groupflow config` printing a user's defaults (explained on request) apart from the
quickstart's, runs named after their config file, and `groupflow --version`."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import yaml

from groupflow.config import Config
from groupflow.config.reference import (
    TABLE_END,
    TABLE_START,
    _keys,
    _sections_in,
    reference_table,
    with_reference_table,
)
from groupflow.reward_workers.tasks import TASKS, task_class
from groupflow.run.cli import main
from groupflow.run.job_config import build_config, load_config, small_model_config

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "config.md"


# ----- the reference ---------------------------------------------------------------------------
def test_every_key_has_a_description():
    undescribed = [key for key, field in _keys(Config, "") if not field.description]
    assert undescribed == []


def test_the_reference_table_in_docs_is_the_schemas():
    assert with_reference_table(DOC.read_text()) == DOC.read_text(), (
        "docs/config.md's table is stale: python -m groupflow.config.reference docs/config.md"
    )


def test_the_reference_table_names_every_key_with_type_default_and_description():
    table = reference_table()
    for key in ["model.dtype", "rollout.gpu_memory_utilization", "rollout.kv_cache_gib",
                "learner.optimizer.betas", "learner.optimizer.weight_decay",
                "learner.optimizer.max_grad_norm", "learner.zero_stage",
                "learner.lora.rank", "task.eval_sets[].size", "agent.tool_parser"]:  # fmt: skip
        assert f"| `{key}` |" in table, key
    row = next(line for line in table.splitlines() if line.startswith("| `model.dtype` |"))
    assert row.split(" | ")[1:3] == ["float32 or bfloat16 or float16", "`float32`"]
    row = next(line for line in table.splitlines() if line.startswith("| `rollout.max_model_len"))
    assert row.split(" | ")[1:3] == ["int (>= 8)", "`2048`"]


def test_a_stale_table_is_replaced_and_a_doc_without_markers_is_refused():
    stale = f"intro\n{TABLE_START}\n| old |\n{TABLE_END}\nafter\n"
    fresh = with_reference_table(stale)
    assert fresh.startswith("intro\n") and fresh.endswith(f"{TABLE_END}\nafter\n")
    assert "| old |" not in fresh and reference_table() in fresh
    with pytest.raises(ValueError, match="markers"):
        with_reference_table("no markers here")


def test_the_docs_name_every_option_of_every_task():
    """The task options are written by hand: each task's section must still name every keyword
    its constructor takes."""
    doc = DOC.read_text()
    section = doc[doc.index("## Task options") :]
    for name in TASKS:
        start = section.index(f"### `{name}`")
        end = section.find("\n### ", start + 1)
        text = section[start : end if end > 0 else None]
        for option in inspect.signature(task_class(name)).parameters:
            assert re.search(rf"`{option}`", text), f"{name}: option {option} undocumented"


def _is_schema_key(path: list[str]) -> bool:
    section = Config
    for part in path[:-1]:
        field = section.model_fields.get(part)
        inner = _sections_in(field.annotation) if field is not None else []
        if not inner:
            return False
        section = inner[0]
    return path[-1] in section.model_fields


# ----- groupflow config -----------------------------------------------------------------------
def _printed(capsys, argv: list[str]) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def test_config_with_no_file_prints_the_defaults_of_a_users_job(capsys):
    printed = yaml.safe_load(_printed(capsys, ["config"]))
    assert printed == build_config({}).model_dump(mode="json")
    assert printed["learner"]["optimizer"]["lr"] == 1e-5 and printed["trainer"]["steps"] == 20
    assert printed["rollout"]["sampling"]["max_tokens"] == 1024
    assert printed["rollout"]["max_model_len"] == 2048
    assert printed["trainer"]["run_name"] == "run"


def test_config_quickstart_prints_the_quickstarts_job(capsys):
    printed = yaml.safe_load(_printed(capsys, ["config", "--quickstart"]))
    assert printed == load_config(None).model_dump(mode="json")
    assert printed["learner"]["optimizer"]["lr"] == 1e-4 and printed["trainer"]["steps"] == 60
    assert printed["trainer"]["run_name"] == "quickstart"


def test_the_quickstart_keeps_the_sizes_of_its_small_model():
    cfg = load_config(None)
    assert cfg.rollout.max_model_len == 256 and cfg.rollout.sampling.max_tokens == 16
    assert cfg.model.dtype == "float32" and cfg.model.path is None
    small = small_model_config({"task": {"name": "countdown"}}, ["rollout.num_engines=2"])
    assert (small.rollout.max_model_len, small.rollout.sampling.max_tokens) == (256, 16)
    assert small.task.name == "countdown" and small.rollout.num_engines == 2
    assert small.learner.optimizer.lr == build_config({}).learner.optimizer.lr


@pytest.mark.parametrize(
    "argv",
    [
        ["config", "--explain"],
        ["config", "--quickstart", "--explain"],
        ["config", "--explain", "--set", "task=[{name: math, weight: 2}, {name: countdown}]"],
    ],
)
def test_explain_comments_every_key_and_loads_back_to_the_same_config(capsys, argv):
    text = _printed(capsys, argv)
    plain = _printed(capsys, [a for a in argv if a != "--explain"])
    assert yaml.safe_load(text) == yaml.safe_load(plain)
    lines, path, keys = text.splitlines(), [], 0
    for i, line in enumerate(lines):
        key = re.match(r"^( *)([a-z_0-9]+):", line)
        if key is None:
            continue
        path = path[: len(key[1]) // 2] + [key[2]]
        if _is_schema_key(path):  # not a key inside a value (task.options)
            keys += 1
            assert lines[i - 1].lstrip().startswith("#"), f"{line!r} has no description"
    assert keys > 150
    assert "# the weights' dtype in the engines and the learner" in text


def test_explain_of_a_file_shows_the_files_values(tmp_path, capsys):
    job = tmp_path / "gsm8k.yaml"
    job.write_text("rollout: {group_size: 4}\n")
    text = _printed(capsys, ["config", str(job), "--explain"])
    assert "  group_size: 4\n" in text and "  run_name: gsm8k\n" in text


def test_config_refuses_a_file_and_quickstart_at_once(capsys, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("{}\n")
    assert main(["config", str(job), "--quickstart"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("groupflow: error: ") and "--quickstart" in err


def test_config_reference_prints_the_table(capsys):
    assert _printed(capsys, ["config", "--reference"]) == reference_table()


# ----- run names --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "file, text, overrides, name",
    [
        ("gsm8k.yaml", "{}", [], "gsm8k"),
        ("qwen-math.v2.yml", "trainer: {steps: 3}", [], "qwen-math.v2"),
        ("job.yaml", "trainer: {run_name: mine}", [], "mine"),
        ("job.yaml", "{}", ["trainer.run_name=cli"], "cli"),
        (".hidden.yaml", "{}", [], "hidden"),
    ],
)
def test_a_run_is_named_after_its_config_file(tmp_path, file, text, overrides, name):
    path = tmp_path / file
    path.write_text(text + "\n")
    assert load_config(path, overrides).trainer.run_name == name


def test_the_quickstart_and_a_python_built_job_keep_their_names():
    assert load_config(None).trainer.run_name == "quickstart"
    assert build_config({}).trainer.run_name == "run"


def test_a_malformed_trainer_section_is_the_schemas_to_refuse(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("trainer: 5\n")
    with pytest.raises(Exception, match="trainer"):
        load_config(path)


# ----- --version --------------------------------------------------------------------------------
def test_version_prints_groupflow_and_its_stack_on_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code in (0, None)
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    assert re.match(r"groupflow \S+ \(Python 3\.\d+\.\d+; ray \S+, vllm \S+, deepspeed", out), out


# ----- defaults past a model's positions ----------------------------------------------------------
def test_a_context_past_the_models_positions_is_refused_in_one_line_before_any_engine(tmp_path):
    from groupflow.core.model_dir import ModelDirError
    from groupflow.run.inputs import resolve_model_path

    (tmp_path / "config.json").write_text('{"max_position_embeddings": 1024}')
    with pytest.raises(ModelDirError, match=r"rollout.max_model_len \(2048\) is past the 1024"):
        resolve_model_path(build_config({}, [f"model.path={tmp_path}"]))
    fits = build_config(
        {},
        [f"model.path={tmp_path}", "rollout.max_model_len=1024", "rollout.sampling.max_tokens=512"],
    )
    assert resolve_model_path(fits) == str(tmp_path)
    # the built-in model (256 positions), refused before it is built
    with pytest.raises(ModelDirError, match="the built-in model .* --quickstart"):
        resolve_model_path(build_config({}))


@pytest.mark.parametrize(
    "heads, kv, tp, refused",
    [
        (14, 2, 2, None),
        (14, 2, 1, None),
        (16, 4, 8, None),  # each key/value head on 2 workers
        (14, 2, 4, "does not divide its 14 attention heads of m; one of [1, 2, 14] does"),
        (16, 4, 16, None),
        (24, 8, 3, "does not divide its 8 key/value heads"),
        (16, 16, 3, "does not divide its 16 attention heads"),
    ],
)
def test_a_tensor_parallel_size_that_does_not_split_the_heads_is_refused(heads, kv, tp, refused):
    """vLLM refused it only after the engine started, as '1 validation error for VllmConfig',
    naming neither setting (issue 39)."""
    from groupflow.core.model_dir import ModelDirError, check_tensor_parallel

    config = {"num_attention_heads": heads, "num_key_value_heads": kv}
    if refused is None:
        check_tensor_parallel(tp, config, "m")
        check_tensor_parallel(tp, {"text_config": config}, "m")
        return
    for nested in (config, {"text_config": config}):
        with pytest.raises(ModelDirError) as err:
            check_tensor_parallel(tp, nested, "m")
        assert str(err.value).startswith(f"rollout.tensor_parallel_size: {tp} ")
        assert refused in str(err.value)


def test_the_job_is_refused_before_the_tokenizer_is_read(tmp_path):
    from groupflow.core.model_dir import ModelDirError
    from groupflow.run.inputs import check_inputs

    (tmp_path / "config.json").write_text('{"num_attention_heads": 14, "num_key_value_heads": 2}')
    cfg = build_config(
        {},
        [
            f"model.path={tmp_path}",
            "rollout.tensor_parallel_size=4",
            "rollout.resources.num_gpus=4",
        ],
    )
    with pytest.raises(ModelDirError, match="rollout.tensor_parallel_size: 4 does not divide"):
        check_inputs(cfg)


@pytest.mark.parametrize(
    "config, context",
    [
        ({"max_position_embeddings": 32768}, 32768),
        ({"n_positions": 1024}, 1024),
        ({"max_position_embeddings": 4096, "seq_length": 2048}, 2048),
        ({"max_position_embeddings": 8192, "rope_scaling": {"type": "yarn", "factor": 4}}, None),
        ({"hidden_size": 64}, None),
        ({"max_position_embeddings": "many"}, None),
    ],
)
def test_a_models_context_is_read_from_its_config(config, context):
    from groupflow.core.model_dir import model_context

    assert model_context(config) == context
