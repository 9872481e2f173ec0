"""A job is never driven through Ray Client (ray://): refused before anything starts, in one
line that says to use `groupflow submit` and why."""

from __future__ import annotations

import pytest

from groupflow.config import ConfigError
from groupflow.core.errors import RunError
from groupflow.loop.checkpoint import CheckpointStore
from groupflow.run import driver
from groupflow.run.job_config import build_config


@pytest.mark.parametrize("address", ["ray://head:10001", " RAY://10.0.0.1:10001"])
def test_a_ray_client_address_is_refused_in_the_config(address):
    with pytest.raises(ConfigError) as err:
        build_config({"cluster": {"address": address}})
    line = str(err.value)
    assert line.startswith("cluster.address: ") and "\n" not in line
    assert "groupflow submit" in line and "streaming actor methods" in line


@pytest.mark.parametrize("address", ["auto", "10.0.0.1:6379", None])
def test_other_addresses_pass(address):
    assert build_config({"cluster": {"address": address}}).cluster.address == address


def test_a_ray_client_address_in_RAY_ADDRESS_is_refused_before_the_run_opens(monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    monkeypatch.setattr(driver.ray, "is_initialized", lambda: False)
    cfg = build_config({"trainer": {"output_dir": str(tmp_path)}})
    with pytest.raises(RunError, match=r"^RAY_ADDRESS: ray://head:10001 is a Ray Client"):
        driver.open_run(cfg, CheckpointStore(tmp_path), None)
    assert list(tmp_path.iterdir()) == []  # nothing was made
