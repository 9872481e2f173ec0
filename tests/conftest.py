"""Shared fixtures. Integration tests share ONE local Ray cluster for the whole session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The quickstart model is built once per machine and cached; tests use the same cache.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    # The integration tests' plugins (tests/integration/plugins) importable by module name on
    # the cluster, as a user's installed package is: the workers inherit this from the raylet.
    plugins = str(Path(__file__).parent / "integration" / "plugins")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (plugins, os.environ.get("PYTHONPATH")) if p
    )
    # Logical CPUs: actors declare fractions of them; the real 2 cores are shared by design.
    ray.init(num_cpus=8, log_to_driver=False, include_dashboard=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def rank_process():
    """One spawned process that plays a DeepSpeed ZeRO-3 learner rank of world size 1 (DeepSpeed
    stays out of pytest's process), shared by the tests that need one
    (tests/integration/test_token_head_zero3.py, test_checkpoint_zero3.py): its start and
    imports are paid once."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


@pytest.fixture(scope="session")
def quickstart_model() -> str:
    from groupflow.config import Config
    from groupflow.run.quickstart import quickstart_model_path

    cfg = Config()
    return str(
        quickstart_model_path(
            cfg.task.name, cfg.task.options, cfg.model.warm_start_steps, progress=False
        )
    )


# Warm-start steps of the tool task's built-in model in the tests: enough to write tool calls
# now and then, far from the 300 of a real run (each step costs about a second here).
TOOL_MODEL_WARM_START = 30


@pytest.fixture(scope="session")
def tool_model() -> str:
    """The built-in model of the tool_arithmetic task, briefly warm-started."""
    from groupflow.run.quickstart import quickstart_model_path

    return str(quickstart_model_path("tool_arithmetic", {}, TOOL_MODEL_WARM_START, progress=False))


@pytest.fixture(scope="session")
def small_moe_model() -> str:
    """The small Qwen3-MoE (groupflow/run/small_moe.py), briefly warm-started like the tool model."""
    from groupflow.run.small_moe import small_moe_path

    return str(small_moe_path(warm_start_steps=TOOL_MODEL_WARM_START, progress=False))


# A chat template in the quickstart tokenizer's alphabet: "S(...) U(...) A(" with a generation
# prompt, so the quickstart model becomes a local chat model (no download).
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] | upper }}({{ m['content'] }}) {% endfor %}"
    "{% if add_generation_prompt %}A({% endif %}"
)
CHAT_SYSTEM_PROMPT = "answer with a number"


@pytest.fixture(scope="session")
def chat_model(quickstart_model, tmp_path_factory) -> str:
    """The quickstart model with CHAT_TEMPLATE saved in its tokenizer."""
    import shutil

    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("chat_model")
    shutil.copytree(quickstart_model, path, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(quickstart_model)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return str(path)
