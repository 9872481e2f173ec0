"""Shared fixtures. Integration tests share ONE local Ray cluster for the whole session."""

from __future__ import annotations

import os

import pytest

# The quickstart model is built once per machine and cached; tests use the same cache.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    # Logical CPUs: actors declare fractions of them; the real 2 cores are shared by design.
    ray.init(num_cpus=8, log_to_driver=False, include_dashboard=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def quickstart_model() -> str:
    from groupflow.config import Config
    from groupflow.quickstart import quickstart_model_path

    cfg = Config()
    return str(
        quickstart_model_path(
            cfg.task.name, cfg.task.options, cfg.model.warm_start_steps, progress=False
        )
    )
