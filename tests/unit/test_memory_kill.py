"""An actor killed by Ray's memory monitor, said in one line (actors/memory_kill.py): Ray's
paragraph, as Ray 2.x writes it for a task of the killed actor (OutOfMemoryError) and for a
later call to it (ActorDiedError), becomes the line the job ends or replaces the actor with."""

from __future__ import annotations

import pytest
import ray
from ray.core.generated.common_pb2 import ActorDiedErrorContext

from groupflow.actors.futures import RayFutures
from groupflow.actors.memory_kill import killed_for_memory, memory_kill_line
from groupflow.core.peers import PeerDied

# The text of Ray 2.60's raylet (its format strings), filled in as it fills them.
RAY_OOM = (
    "Task was killed due to the node running low on memory.\n"
    "Memory on the node (IP: 10.0.0.5, ID: 6f1c0b2a) was 22.91GB used / 24.00GB limit "
    "(0.954583), which exceeds the memory usage threshold of 0.95. Ray killed this worker "
    "(job ID=01000000, lease ID=ab12, task name={task}, required resources={{CPU: 0.5}}, "
    "actor ID=9e1f, pid=4242, actual memory used=9.13GB, worker ID=77aa) because it was the "
    "most recently scheduled task; to see more information about memory usage on this node, "
    "use `ray logs raylet.out -ip 10.0.0.5`. Top 10 memory users: ... Refer to the "
    "documentation on how to address the out of memory issue: https://docs.ray.io/en/latest/"
    "ray-observability/user-guides/debug-apps/debug-memory.html. Consider provisioning more "
    "memory on this node or reducing task parallelism by requesting more CPUs per task. To "
    "adjust the kill threshold, set the environment variable `RAY_memory_usage_threshold` when "
    "starting Ray. To disable worker killing, set the environment variable "
    "`RAY_memory_monitor_refresh_ms` to zero."
)


@pytest.mark.parametrize(
    ("task", "named", "setting"),
    [
        (
            "LearnerRankActor.train_step",
            "a learner rank (LearnerRankActor)",
            "learner.micro_batch_tokens",
        ),
        ("Generator.generate", "an engine (Generator)", "rollout.kv_cache_gib"),
        ("RewardWorker.score", "a reward worker (RewardWorker)", "reward.num_workers"),
    ],
)
def test_a_task_killed_for_memory_is_one_line_naming_the_actor_and_the_setting(
    task, named, setting
):
    err = ray.exceptions.OutOfMemoryError(RAY_OOM.format(task=task))
    assert killed_for_memory(err)
    line = memory_kill_line(err)
    assert "\n" not in line and len(line) < 200, line
    assert line.startswith(f"{named} was killed by Ray's memory monitor")
    assert "holding 9.13 GB resident" in line
    assert "node 10.0.0.5 at 22.91 GB of 24.00 GB" in line
    assert line.endswith(setting) or f"lower {setting}" in line


def _actor_died(detail: str) -> ray.exceptions.ActorDiedError:
    context = ActorDiedErrorContext(
        class_name="LearnerRankActor",
        actor_id=b"\x01" * 16,
        pid=4242,
        node_ip_address="10.0.0.5",
        error_message="The actor is dead because its worker process has died. Worker exit "
        f"type: NODE_OUT_OF_MEMORY Worker exit detail: {detail}",
    )
    return ray.exceptions.ActorDiedError(context)


def test_a_later_call_to_the_killed_actor_says_the_same():
    err = _actor_died(RAY_OOM.format(task="LearnerRankActor.train_step"))
    assert killed_for_memory(err)
    line = memory_kill_line(err)
    assert line.startswith("a learner rank (LearnerRankActor) was killed by Ray's memory monitor")
    assert "holding 9.13 GB" in line and "lower learner.micro_batch_tokens" in line


def test_other_deaths_are_not_memory_kills():
    context = ActorDiedErrorContext(
        class_name="Generator", actor_id=b"\x02" * 16, error_message="killed by ray.kill"
    )
    assert not killed_for_memory(ray.exceptions.ActorDiedError(context))


class _Raising:
    """ray.get's place in RayFutures.get: raises what Ray raises for a dead actor's call."""

    def __init__(self, err):
        self.err = err

    def __call__(self, refs):
        raise self.err


def test_futures_turn_a_memory_kill_into_peer_died_with_the_line(monkeypatch):
    """Before this, Ray's OutOfMemoryError (not a RayActorError) went past RayFutures.get:
    the job ended in Ray's paragraph instead of replacing or naming the actor."""
    err = ray.exceptions.OutOfMemoryError(RAY_OOM.format(task="LearnerRankActor.train_step"))
    monkeypatch.setattr(ray, "get", _Raising(err))
    with pytest.raises(PeerDied) as died:
        RayFutures().get(["a handle"])
    assert str(died.value) == memory_kill_line(err)
    assert died.value.__cause__ is err
