"""Placement you can see, on the shared local Ray cluster: a pool no node can hold fails the
job at cluster.placement_timeout_s with one line naming it (groupflow/core/placement.py), in
seconds (the unplaced engine never loads a model; nothing trains)."""

from __future__ import annotations

import time

import pytest

from groupflow.run.cli import main

pytestmark = pytest.mark.integration


def test_an_unplaceable_pool_fails_the_job_in_one_line(
    ray_cluster, quickstart_model, tmp_path, capsys
):
    import ray
    from ray._private import state

    groups_before = set(ray.util.placement_group_table())
    started = time.monotonic()
    code = main(
        [
            "train",
            "--set",
            f"trainer.output_dir={tmp_path}",
            "--set",
            "trainer.run_name=unplaceable",
            "--set",
            "rollout.resources.custom.nobody_has_this=1",
            "--set",
            "cluster.placement_timeout_s=3",
            "--set",  # the quickstart's 400 held-out prompts are more than its task has: the
            "task.eval_size=8",  # search for them alone would take seconds before anything starts
        ]
    )
    took = time.monotonic() - started
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1, err
    line = err[-1]
    assert line.startswith("groupflow: error: engines: 1 of 1 not placed"), err
    assert "cluster.placement_timeout_s=3" in line
    # what one engine asks for: the custom resource, and the engines' default 0.5 CPU kept
    assert "{CPU: 0.5, nobody_has_this: 1} (rollout.resources)" in line
    assert "no nobody_has_this" in line and "CPU " in line
    assert 3 <= took < 60
    print(f"failed after {took:.1f}s")
    # Nothing of the job is left on the shared cluster: its actors and placement group went.
    ours = {"Generator", "RewardWorker", "LearnerRankActor", "JobControl"}
    deadline = time.monotonic() + 10
    while (
        alive := [
            a
            for a in state.actors().values()
            if a["ActorClassName"] in ours and a["State"] != "DEAD"
        ]
    ) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive
    new_groups = set(ray.util.placement_group_table()) - groups_before
    table = ray.util.placement_group_table()
    assert new_groups and all(table[g]["state"] == "REMOVED" for g in new_groups)


class _NeedsAModel:
    def __init__(self, path: str):
        open(path)  # noqa: SIM115 - a node without the model fails here


def test_an_actor_that_dies_starting_fails_with_its_own_error_and_node(ray_cluster, tmp_path):
    import ray

    from groupflow.actors.starting import wait_started
    from groupflow.core.start_errors import StartError

    missing = tmp_path / "not-on-this-node" / "config.json"
    actor = ray.remote(_NeedsAModel).options(num_cpus=0.1).remote(str(missing))
    with pytest.raises(StartError) as err:
        wait_started("engine", [actor.__ray_ready__.remote()])
    assert str(err.value) == (
        f"an engine failed to start on node {ray.util.get_node_ip_address()}: "
        f"FileNotFoundError: [Errno 2] No such file or directory: '{missing}'"
    )
