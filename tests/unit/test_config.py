import copy
import math
import time
import tracemalloc
import typing

import pytest
from pydantic import BaseModel, ValidationError

from groupflow.config import Config, ConfigError, Section, parse_override, parse_yaml
from groupflow.run.job_config import build_config, load_config


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
        ({}, ["rollout.sampling.max_tokens=2048"], "rollout.sampling.max_tokens"),
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


# ----- one rule for every number in the schema ------------------------------------------------
# Sections that exist only when set, or have required keys, made present so that their fields
# are walked too.
PRESENT = {
    "rollout": {"num_engines": 2, "autoscale": {"max_engines": 2}},
    "reward": {"overlong_penalty": {"buffer_tokens": 4}},
    "task": {"eval_sets": [{"name": "held", "task": "arithmetic"}]},
    "learner": {"lora": {}},
}


def _mentions(annotation, kinds) -> bool:
    return annotation in kinds or any(_mentions(a, kinds) for a in typing.get_args(annotation))


def _leaf_fields(model: type[BaseModel], value: BaseModel, path: list):
    """(path, annotation, current value) of every setting that is not itself a section."""
    for name, info in model.model_fields.items():
        current = getattr(value, name)
        if isinstance(current, Section):
            yield from _leaf_fields(type(current), current, [*path, name])
        elif current and isinstance(current, list) and isinstance(current[0], Section):
            yield from _leaf_fields(type(current[0]), current[0], [*path, name, 0])
        else:
            yield [*path, name], info.annotation, current


def _hostile_numbers(annotation, current) -> list:
    """The setting's value with a NaN, an infinity or a too-large integer in it."""
    if isinstance(current, tuple | list) and current:
        return [[bad, *current[1:]] for bad in (math.nan, math.inf)]
    if isinstance(current, dict):
        if _mentions(annotation, (typing.Any,)):  # free-form: a number deep inside too
            return [{"k": math.nan}, {"k": [1, {"j": -math.inf}]}]
        return [{"k": math.nan}, {"k": math.inf}]
    if _mentions(annotation, (float,)):
        return [math.nan, math.inf, -math.inf]
    if _mentions(annotation, (int,)) and not _mentions(annotation, (bool,)):
        return [2**63, -(2**64)]
    return []


def _nested(path: list, value) -> dict:
    tree = copy.deepcopy(PRESENT)
    node = tree
    for part, following in zip(path, path[1:], strict=False):
        default = [{}] if isinstance(following, int) else {}
        node = node.setdefault(part, default) if isinstance(node, dict) else node[part]
    node[path[-1]] = value
    return tree


def _hostile_cases():
    present = build_config(PRESENT)
    for path, annotation, current in _leaf_fields(Config, present, []):
        for value in _hostile_numbers(annotation, current):
            yield ".".join(map(str, path)), path, value


HOSTILE_NUMBERS = list(_hostile_cases())


def test_the_walk_reaches_every_number_setting():
    walked = {key for key, _, _ in HOSTILE_NUMBERS}
    # a sample from each kind: nested sections, tuples, dicts of floats, free-form options
    for key in (
        "algorithm.entropy_coef",
        "learner.optimizer.betas",
        "rollout.sampling.temperature",
        "rollout.resources.custom",
        "task.options",
        "task.eval_sets.0.options",
        "reward.overlong_penalty.max_penalty",
        "algorithm.clip.dual_clip",
        "cluster.num_cpus",
        "trainer.seed",
    ):
        assert key in walked
    assert len(walked) > 60


@pytest.mark.parametrize("key, path, value", HOSTILE_NUMBERS, ids=lambda v: str(v)[:40])
def test_every_number_setting_refuses_nan_infinity_and_huge_integers(key, path, value):
    with pytest.raises(ConfigError) as err:
        build_config(_nested(path, value))
    message = str(err.value)
    assert "\n" not in message and message.startswith((f"{key}:", f"{key}.")), message


def _boolean_cases():
    """Every number setting (not one that is a bool itself), with a boolean where a number
    goes: the setting itself, or the first item of its tuple, list or mapping."""
    present = build_config(PRESENT)
    for path, annotation, current in _leaf_fields(Config, present, []):
        if not _mentions(annotation, (int, float)) or _mentions(annotation, (bool, typing.Any)):
            continue
        if isinstance(current, tuple | list):
            value = [True, *current[1:]] if current else [True]
        elif isinstance(current, dict) or _mentions(annotation, (dict,)):
            value = {"k": True}
        else:
            value = True
        yield ".".join(map(str, path)), path, value


BOOLEAN_CASES = list(_boolean_cases())


def test_the_boolean_walk_reaches_every_kind_of_number_setting():
    walked = {key for key, _, _ in BOOLEAN_CASES}
    for key in (
        "learner.lora.rank",
        "learner.lora.alpha",
        "learner.optimizer.betas",
        "rollout.resources.cpu_cores",
        "rollout.resources.custom",
        "rollout.sampling.seed",
        "cluster.num_cpus",
        "trainer.seed",
    ):
        assert key in walked
    assert len(walked) > 60


@pytest.mark.parametrize("key, path, value", BOOLEAN_CASES, ids=lambda v: str(v)[:40])
def test_no_number_setting_takes_a_boolean(key, path, value):
    """YAML's `true` is 1 to pydantic's lax int and float: `learner.lora.rank: true` was a
    rank-1 adapter."""
    with pytest.raises(ConfigError) as err:
        build_config(_nested(path, value))
    message = str(err.value)
    assert "\n" not in message and message.startswith((f"{key}:", f"{key}.")), message


@pytest.mark.parametrize(
    ("override", "problem"),
    [
        ("learner.lora.rank=true", "learner.lora.rank: Input should be a valid integer (got True)"),
        ("learner.lora.rank=16.0", "learner.lora.rank: Input should be a valid integer"),
        ("trainer.steps='20'", "trainer.steps: Input should be a valid integer"),
        (
            "learner.lora.alpha=1e300",
            "learner.lora.alpha: Input should be less than or equal to 1024",
        ),
        ("learner.lora.alpha=false", "learner.lora.alpha: a boolean is not a number"),
        (
            "learner.optimizer.lr=2.0",
            "learner.optimizer.lr: Input should be less than or equal to 1",
        ),
        (
            "learner.optimizer.weight_decay=5.0",
            "learner.optimizer.weight_decay: Input should be less",
        ),
        (
            "algorithm.clip.eps_low=1.5",
            "algorithm.clip.eps_low: Input should be less than or equal",
        ),
        ("algorithm.kl.coef=1e30", "algorithm.kl.coef: Input should be less than or equal to 10"),
        ("algorithm.entropy_coef=-1e300", "algorithm.entropy_coef: Input should be greater than"),
        ("algorithm.off_policy.cap=1e9", "algorithm.off_policy.cap: Input should be less than"),
        ("algorithm.clip.eps_high=1e300", "algorithm.clip.eps_high: Input should be less than"),
        ("algorithm.clip.dual_clip=1e300", "algorithm.clip.dual_clip: Input should be less than"),
        (
            "algorithm.off_policy.band=[0.5, 1e300]",
            "algorithm.off_policy: band [0.5, 1e+300]: must satisfy",
        ),
        (
            "rollout.resources.custom={gpu_slot: -1}",
            "rollout.resources.custom.gpu_slot: Input should be greater",
        ),
        # the settings of the last round (issue 39's hostile pass over them)
        ("learner.memory_gib=1e-300", "learner.memory_gib: Input should be greater than or"),
        ("learner.memory_gib=.inf", "learner.memory_gib: Input should be less than or equal"),
        # a union setting: one line at the setting's own path, naming what each type takes
        (
            "learner.micro_batch_tokens=Auto",
            "learner.micro_batch_tokens: Input should be a valid integer; or 'auto' (got 'Auto')",
        ),
        (
            "learner.gradient_checkpointing=yes",
            "learner.gradient_checkpointing: Input should be a valid boolean; or 'auto' (got",
        ),
        ("learner.micro_batch_tokens=0", "learner.micro_batch_tokens: must be auto or at least"),
        ("learner.sequence_parallel_size=3", "learner: sequence_parallel_size=3 does not divide"),
        ("learner.sequence_parallel_size=0", "learner.sequence_parallel_size: Input should be"),
        ("reward.max_infra_failure_share=1.5", "reward.max_infra_failure_share: Input should"),
        ("reward.max_infra_failure_share=.nan", "reward.max_infra_failure_share: Input should"),
        ("learner.moe.leaf_modules=2", "learner.moe.leaf_modules: Input should be a valid bool"),
        ("learner.moe=null", "learner.moe: Input should be a valid dictionary"),
        ("learner.moe.experts=4", "learner.moe.experts: unknown key"),
        # numpy, inside every engine's start, refuses a seed outside [0, 2**32)
        ("trainer.seed=-1", "trainer.seed: Input should be greater than or equal to 0"),
        ("trainer.seed=4294967296", "trainer.seed: Input should be less than or equal to"),
    ],
)
def test_ranges_are_strict_and_refused_in_one_line(override, problem):
    raw = {"reward": {"overlong_penalty": {"buffer_tokens": 4}}} if "overlong" in override else {}
    with pytest.raises(ConfigError) as err:
        build_config(raw, [override])
    assert str(err.value).startswith(problem) and "\n" not in str(err.value), str(err.value)


def _whole_float_cases():
    """Every integer setting with a whole float where its integer goes: lax pydantic reads
    16.0 as 16, so a float typed for an integer would pass unnoticed."""
    present = build_config(PRESENT)
    for path, annotation, current in _leaf_fields(Config, present, []):
        if not _mentions(annotation, (int,)) or _mentions(annotation, (float, bool, typing.Any)):
            continue
        if isinstance(current, list):
            value = [1.0]
        else:
            value = float(current) if isinstance(current, int) else 1.0
        yield ".".join(map(str, path)), path, value


WHOLE_FLOATS = list(_whole_float_cases())


def test_the_whole_float_walk_reaches_the_integer_settings():
    walked = {key for key, _, _ in WHOLE_FLOATS}
    assert {"learner.lora.rank", "rollout.resources.cpu_cores", "trainer.steps"} <= walked
    assert not walked & {"learner.lora.alpha", "rollout.resources.custom"}
    assert len(walked) > 40


@pytest.mark.parametrize("key, path, value", WHOLE_FLOATS, ids=lambda v: str(v)[:40])
def test_no_integer_setting_takes_a_float(key, path, value):
    with pytest.raises(ConfigError) as err:
        build_config(_nested(path, value))
    message = str(err.value)
    assert "\n" not in message and message.startswith((f"{key}:", f"{key}.")), message


def test_numbers_in_their_usual_forms_still_pass():
    cfg = build_config(
        {},
        [
            "learner.optimizer.lr=1e-5",  # a string to YAML 1.1: still a number
            "learner.lora.alpha=64",  # an int where a float goes
            "learner.lora.rank=8",
            "algorithm.entropy_coef=-0.001",
            "algorithm.dynamic_sampling=true",
        ],
    )
    assert cfg.learner.optimizer.lr == 1e-5 and cfg.learner.lora.alpha == 64.0
    assert type(cfg.learner.lora.alpha) is float and type(cfg.learner.lora.rank) is int


def test_a_non_finite_number_is_refused_on_assignment_too():
    cfg = Config()
    with pytest.raises(ValidationError):
        cfg.algorithm.entropy_coef = math.nan


@pytest.mark.parametrize("betas", [[1.0, 0.9], [0.9, -0.1], [0.9, 1.5]])
def test_adam_betas_lie_in_0_1(betas):
    with pytest.raises(ConfigError, match=r"^learner\.optimizer\.betas\.[01]: "):
        build_config({"learner": {"optimizer": {"betas": betas}}})


# ----- bounded YAML --------------------------------------------------------------------------
def _alias_bomb(levels: int = 30) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    return "\n".join(lines) + "\n"


HOSTILE_YAML = {
    "alias_bomb": (_alias_bomb(), "expands to more than"),
    "merge_key_bomb": (
        "a0: &a0 {k0: 1, k1: 1}\n"
        + "".join(
            f"a{i}: &a{i} {{<<: [{', '.join([f'*a{i - 1}'] * 10)}], k{i}: 1}}\n"
            for i in range(1, 12)
        ),
        "expands to more than",
    ),
    "deep_flow": ("a: " + "[" * 10_000 + "]" * 10_000 + "\n", "nested deeper than"),
    "deep_block": ("".join(" " * i + f"k{i}:\n" for i in range(200)) + " " * 200 + "v\n", "deeper"),
    "deep_mapping_flow": ("a: " + "{a: " * 5000 + "1" + "}" * 5000 + "\n", "nested deeper"),
    "recursive_sequence": ("a: &a [1, *a]\n", "refers to a node that contains it"),
    "recursive_mapping": ("a: &a {b: *a}\n", "refers to a node that contains it"),
    "recursive_merge": ("a: &a {<<: *a}\n", "refers to a node that contains it"),
    "long_integer": ("trainer:\n  steps: " + "9" * 5000 + "\n", "integer of 5000 digits"),
    "long_hex_integer": ("trainer:\n  seed: 0x" + "f" * 4000 + "\n", "integer of 4000 digits"),
    "long_signed_integer": ("task:\n  seed: -" + "1_" * 3000 + "\n", "integer of 3000 digits"),
    "not_a_mapping": ("- 1\n- 2\n", "top level must be a mapping"),
}


def _load_hostile(tmp_path, name: str, content: str | bytes) -> str:
    path = tmp_path / f"{name}.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    started = time.monotonic()
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError) as err:
            load_config(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.monotonic() - started < 3
    assert peak < 200 << 20
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{path}: "), message
    return message


@pytest.mark.parametrize("name", list(HOSTILE_YAML))
def test_hostile_yaml_fails_fast_in_one_line_naming_the_file(tmp_path, name):
    content, problem = HOSTILE_YAML[name]
    assert problem in _load_hostile(tmp_path, name, content)


@pytest.mark.parametrize(
    "content",
    [b"trainer:\n  run_name: \xff\xfe\n", b"\xc3\x28: 1\n", b"a: '\xed\xa0\x80'\n"],
    ids=["invalid_start_byte", "bad_continuation", "encoded_surrogate"],
)
def test_a_file_that_is_not_utf8_is_one_line(tmp_path, content):
    assert "not UTF-8 text" in _load_hostile(tmp_path, "latin", content)


def test_a_huge_file_is_refused_without_being_read(tmp_path):
    path = tmp_path / "huge.yaml"
    with path.open("wb") as f:
        f.truncate(100 << 20)  # 100 MB, sparse
    with pytest.raises(ConfigError, match=rf"^{path}: larger than 1 MiB"):
        load_config(path)


def test_real_aliases_within_the_bounds_still_work():
    tree = parse_yaml("base: &b {num_cpus: 0.5}\nrollout: {resources: *b}\n")
    assert tree["rollout"]["resources"] == {"num_cpus": 0.5}


@pytest.mark.parametrize(
    "value, problem",
    [
        ("[&a [1,1,1,1,1,1,1,1,1,1], " + ", ".join(["*a"] * 10) + "]", None),
        ("[" * 5000 + "]" * 5000, "nested deeper"),
        ("9" * 5000, "integer of 5000 digits"),
        ("&a [*a]", "refers to a node that contains it"),
    ],
    ids=["fine", "deep", "long_integer", "recursive"],
)
def test_set_values_go_through_the_same_bounded_reader(value, problem):
    if problem is None:
        assert parse_override(f"task.options.x={value}")[1][1] == [1] * 10
        return
    with pytest.raises(ConfigError, match=problem) as err:
        build_config({}, [f"task.options.x={value}"])
    assert str(err.value).startswith("--set task.options.x: ")
    assert "\n" not in str(err.value)


# ----- engine settings (rollout/engine.py) -------------------------------------------------------
@pytest.mark.parametrize(
    "override, problem",
    [
        (
            "rollout.tensor_parallel_size=2 rollout.resources.num_gpus=1",
            r"^rollout: tensor_parallel_size \(2\) must equal resources.num_gpus \(1\)",
        ),
        (
            "rollout.tensor_parallel_size=4 rollout.resources.cpu_cores=[0,1]",
            r"^rollout: tensor_parallel_size \(4\) needs as many cores",
        ),
        ("rollout.tensor_parallel_size=0", r"^rollout\.tensor_parallel_size: "),
        ("rollout.max_num_seqs=0", r"^rollout\.max_num_seqs: "),
        ("rollout.enforce_eager=sometimes", r"^rollout\.enforce_eager: "),
        # vLLM refuses it only at the first request, on the engine
        ("rollout.sampling.temperature=2.5", r"^rollout\.sampling\.temperature: "),
    ],
)
def test_engine_settings_out_of_range_are_one_line_naming_the_key(override, problem):
    with pytest.raises(ConfigError, match=problem) as err:
        build_config({}, override.split())
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("gpus", [0.0, 1.0])
@pytest.mark.parametrize("eager", [None, True, False])
def test_engine_settings_reach_the_engine_eager_by_default_only_on_cpu(gpus, eager):
    from groupflow.rollout.engine import engine_settings

    overrides = [
        f"rollout.resources.num_gpus={gpus}",
        "rollout.max_num_seqs=48",
        "rollout.enable_prefix_caching=false",
    ]
    if eager is not None:
        overrides.append(f"rollout.enforce_eager={str(eager).lower()}")
    settings = engine_settings(build_config({}, overrides), "/model", seed=3)
    assert settings.enforce_eager is (gpus == 0 if eager is None else eager)
    assert (settings.max_num_seqs, settings.enable_prefix_caching) == (48, False)
    assert settings.tensor_parallel_size == 1 and settings.seed == 3


@pytest.mark.parametrize("mode, captured", [("off", False), ("rollout", True), ("observe", True)])
def test_the_engines_return_routing_where_the_learner_replays_or_compares_it(mode, captured):
    """The routing capture's callbacks run in Python, which a CUDA graph's replay would skip:
    an engine that returns routing runs eager, on GPUs too."""
    from groupflow.rollout.engine import engine_settings

    overrides = [f"learner.moe.routing_replay={mode}", "rollout.resources.num_gpus=1"]
    settings = engine_settings(build_config({}, overrides), "/model", seed=0)
    assert settings.routed_experts is captured and settings.enforce_eager is captured


def test_unset_engine_settings_leave_vllms_defaults():
    from groupflow.rollout.engine import engine_settings

    settings = engine_settings(build_config({}, []), "/model", seed=0)
    assert settings.max_num_seqs is None and settings.enable_prefix_caching is None


def test_tensor_parallel_cpu_workers_split_the_cores_into_neighbour_runs():
    from groupflow.rollout.engine import cpu_threads_bind

    assert cpu_threads_bind([0, 1], 2) == "0|1"
    assert cpu_threads_bind([2, 3, 4, 5, 6], 2) == "2,3,4|5,6"
    assert cpu_threads_bind(list(range(8)), 4) == "0,1|2,3|4,5|6,7"
    with pytest.raises(ValueError, match=r"^rollout.tensor_parallel_size: 3 CPU workers"):
        cpu_threads_bind([0, 1], 3)
