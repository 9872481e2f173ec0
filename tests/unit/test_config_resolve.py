"""The config's one resolve step (groupflow/run/job_config.py): the section models check only their
own values and import no registry; `resolve` checks names against the registries and fills the
settings that others decide, once; every loader returns a resolved config, a run refuses any
other, and the run directory's config.resolved.yaml shows what resolve decided."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from groupflow.config import DERIVED, Config, ConfigError, resolved_yaml
from groupflow.run.job_config import build_config, check_resolved, load_config, resolve

ROOT = Path(__file__).resolve().parents[2]
WINGS = ("groupflow.rollout", "groupflow.learner", "groupflow.reward_workers", "groupflow.actors")
STALE_TOOL_JOB = {"task": {"name": "tool_arithmetic"}, "trainer": {"max_staleness": 2}}


def test_validation_decides_nothing_and_resolve_fills_the_derived_settings():
    validated = Config.model_validate(STALE_TOOL_JOB)
    assert "partial_rollout" not in validated.rollout.model_fields_set
    assert validated.rollout.partial_rollout is False  # the default, untouched
    assert validated.algorithm.off_policy.mode == "none" and validated.agent.tools is None
    resolved = resolve(validated)
    assert resolved is validated
    assert resolved.rollout.partial_rollout is True
    assert resolved.algorithm.off_policy.mode == "tis"
    assert resolved.agent.tools == ["calculator"]
    assert build_config(STALE_TOOL_JOB) == resolved


def test_settings_given_are_kept_and_resolving_again_changes_nothing():
    chosen = ["rollout.partial_rollout=false", "algorithm.off_policy.mode=mis", "agent.tools=[]"]
    cfg = build_config(STALE_TOOL_JOB, chosen)
    assert (cfg.rollout.partial_rollout, cfg.algorithm.off_policy.mode) == (False, "mis")
    assert cfg.agent.tools == [] and not cfg.multi_turn
    for built in (cfg, build_config(STALE_TOOL_JOB), build_config({})):
        assert resolve(built.model_copy(deep=True)) == built
    # null is unset, as the reference says
    assert build_config(STALE_TOOL_JOB, ["rollout.partial_rollout=null"]).rollout.partial_rollout


def test_the_defaults_are_resolved_already():
    assert resolve(Config()) == Config()
    check_resolved(Config())


def test_validating_a_config_loads_no_registry():
    # A job whose eval set, task list and tools each named a registry in the old validators.
    tree = {
        "task": {
            "name": "mixture",
            "options": {"tasks": [{"name": "arithmetic"}, {"name": "countdown"}]},
            "eval_sets": [{"name": "held", "task": "countdown"}],
        },
        "agent": {"tools": ["calculator"]},
    }
    code = (
        "import sys; from groupflow.config import Config; "
        f"Config.model_validate({tree!r}); "
        f"print(sorted(m for m in sys.modules if m.startswith({WINGS!r})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout


@pytest.mark.parametrize(
    "tree, message",
    [
        ({"agent": {"tools": ["nope"]}}, "agent.tools: 'nope' is neither a built-in tool"),
        ({"task": {"eval_sets": [{"name": "x", "task": "nope"}]}}, "task.eval_sets.0: unknown"),
        ({"task": {"name": "mixture", "options": {"tasks": []}}}, "task: a mixture needs"),
        ({"task": {"name": "maths"}}, "task.name: unknown task 'maths'"),
    ],
)
def test_a_name_no_registry_knows_is_one_line_naming_its_key(tree, message):
    with pytest.raises(ConfigError) as err:
        resolve(Config.model_validate(tree))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_run_refuses_a_config_that_was_not_resolved():
    from groupflow.run.driver import check_inputs
    from groupflow.run.eval_model import eval_model

    unresolved = Config.model_validate({"trainer": {"max_staleness": 1}})
    expected = "not resolved.*rollout.partial_rollout, algorithm.off_policy.mode"
    with pytest.raises(RuntimeError, match=expected):  # train, dry run, config --check
        check_inputs(unresolved)
    with pytest.raises(RuntimeError, match=expected):
        eval_model(unresolved, "/no/model")
    with pytest.raises(ConfigError, match="^agent.tools: "):  # names are checked there too
        check_resolved(Config.model_validate({"agent": {"tools": ["nope"]}}))
    check_resolved(build_config({"trainer": {"max_staleness": 1}}))


def test_config_resolved_yaml_shows_what_resolve_decided_and_loads_back(tmp_path):
    from groupflow.run.driver import prepare_run_dir

    cfg = build_config(STALE_TOOL_JOB, ["trainer.run_name=tools"])
    run = prepare_run_dir(cfg, tmp_path / "tools", None)
    text = (run / "config.resolved.yaml").read_text()
    assert text == resolved_yaml(cfg)
    header = [line for line in text.splitlines() if line.startswith("#   ")]
    assert [line.split(":")[0].strip("# ") for line in header] == list(DERIVED)
    assert "#   rollout.partial_rollout: true (unset: on when trainer.max_staleness > 0)" in header
    assert '#   agent.tools: ["calculator"] (unset: ' in text
    assert yaml.safe_load(text) == cfg.model_dump(mode="json")
    assert load_config(run / "config.resolved.yaml") == cfg


def test_the_docs_say_what_each_derived_setting_is_when_unset():
    doc = (ROOT / "docs" / "config.md").read_text()
    table = doc[doc.index("**Resolved.**") : doc.index("## Your job and the quickstart")]
    assert [key for key in DERIVED if f"| `{key}` |" in table] == list(DERIVED)


def test_a_config_saved_before_resolve_existed_still_loads_to_the_same_job(tmp_path):
    """Checkpoints and run directories of earlier versions hold the plain dump, with
    agent.tools unset: resuming from one builds the same job."""
    cfg = build_config(STALE_TOOL_JOB, ["trainer.run_name=tools"])
    old = cfg.model_dump(mode="json")
    old["agent"]["tools"] = None
    path = tmp_path / "config.resolved.yaml"
    path.write_text(yaml.safe_dump(old, sort_keys=False))
    assert load_config(path) == cfg
    assert json.loads(json.dumps(load_config(path).agent_tools())) == ["calculator"]
