"""The Ray side of the startup placement check (groupflow/core/placement.py): how many of a pool's
actors have a node, and what the cluster's live nodes have."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import ray

# The GCS's actor table, which answers without Ray's dashboard (the state API needs one).
from ray._private import state as gcs_state
from ray.util.placement_group import PlacementGroup

from groupflow.config import Config, Resources
from groupflow.core.placement import Placement, PoolAsk
from groupflow.core.scaling_protocol import ray_demand


def has_node(actor: ray.actor.ActorHandle) -> bool:
    """Whether Ray gave the actor a node: it has a worker process there (its constructor may
    still run), or it ran and ended (a failed start is the start check's to report)."""
    info = gcs_state.actors(actor_id=actor._actor_id.hex()) or {}
    return bool(info.get("Pid")) or info.get("State") in ("ALIVE", "DEAD")


def live_nodes() -> tuple[list[dict[str, float]], dict[str, float]]:
    """Each live node's total resources, and what the cluster has free now."""
    nodes = [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]
    return nodes, ray.available_resources()


def _ask(pool: str, key: str, res: Resources, count: int) -> PoolAsk:
    return PoolAsk(pool, key, ray_demand(res.num_cpus, res.num_gpus, res.custom), count)


def _placed(actors: Sequence[ray.actor.ActorHandle]) -> Callable[[], int]:
    return lambda: sum(map(has_node, actors))


def startup_placement(
    cfg: Config,
    engines: Sequence[ray.actor.ActorHandle],
    reward_workers: Sequence[ray.actor.ActorHandle],
    tool_workers: Sequence[ray.actor.ActorHandle],
    learner: PlacementGroup,
) -> None:
    """Wait until the job's first engines, reward workers, tool workers and learner ranks
    (their placement group) have nodes, or raise PlacementError at
    cluster.placement_timeout_s."""
    ranks = cfg.learner.num_ranks
    Placement(
        [
            (
                _ask("engines", "rollout.resources", cfg.rollout.resources, len(engines)),
                _placed(engines),
            ),
            (
                _ask(
                    "reward workers", "reward.resources", cfg.reward.resources, len(reward_workers)
                ),
                _placed(reward_workers),
            ),
            (  # placed like reward workers (actors/tools.py)
                _ask("tool workers", "reward.resources", cfg.reward.resources, len(tool_workers)),
                _placed(tool_workers),
            ),
            (
                _ask("learner ranks", "learner.resources", cfg.learner.resources, ranks),
                lambda: ranks if learner.wait(0) else 0,
            ),
        ],
        live_nodes,
        cfg.cluster.placement_timeout_s,
    ).wait()
