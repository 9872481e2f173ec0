import pytest

from groupflow.config import Config, ConfigError, build_config, load_config


def test_defaults_validate_and_round_trip(tmp_path):
    cfg = Config()
    path = tmp_path / "c.yaml"
    path.write_text(cfg.dump_yaml())
    assert load_config(path) == cfg


def test_overrides_parse_yaml_values():
    cfg = build_config(
        {}, ["learner.optimizer.lr=1e-5", "rollout.group_size=4", "metrics.prometheus_port=9100"]
    )
    assert cfg.learner.optimizer.lr == 1e-5
    assert cfg.rollout.group_size == 4
    assert cfg.metrics.prometheus_port == 9100


@pytest.mark.parametrize(
    "raw, overrides, key",
    [
        ({"rollout": {"group_sise": 4}}, [], "rollout.group_sise"),
        ({}, ["learner.optimizer.lr=fast"], "learner.optimizer.lr"),
        ({}, ["trainer.max_staleness=9"], "trainer.max_staleness"),
        ({}, ["algorithm.preset=nope"], "algorithm"),
        ({"algorithm": {"loss": "dfpo", "aggregation": "seq_mean_token_mean"}}, [], "algorithm"),
        ({}, ["rollout.sampling.max_tokens=999"], "rollout.sampling.max_tokens"),
        ({}, ["rollout.group_size.x=1"], "rollout.group_size"),
    ],
)
def test_bad_config_names_the_key(raw, overrides, key):
    with pytest.raises(ConfigError) as err:
        build_config(raw, overrides)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(key) or f" {key}" in message or key in message


def test_yaml_boolean_words_stay_strings_on_the_command_line():
    cfg = build_config({}, ["trainer.run_name=off", "algorithm.stapo.enabled=true"])
    assert cfg.trainer.run_name == "off" and cfg.algorithm.stapo.enabled is True
    with pytest.raises(ConfigError, match="algorithm.stapo.enabled"):
        build_config({}, ["algorithm.stapo.enabled=yes-please"])


def test_preset_supplies_defaults_and_user_wins():
    cfg = build_config({"algorithm": {"preset": "dr_grpo"}})
    assert (cfg.algorithm.advantage, cfg.algorithm.aggregation) == ("dr_grpo", "constant")
    cfg = build_config({"algorithm": {"preset": "dr_grpo", "aggregation": "token_mean"}})
    assert cfg.algorithm.aggregation == "token_mean"


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
