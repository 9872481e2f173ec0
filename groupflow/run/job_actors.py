"""A job's actors, started together by the driver: the engines (with their tool workers), the
reward workers and the learner ranks, every pool placed within `cluster.placement_timeout_s`
(or one line naming it) and each actor waited for; the weight transport between the ranks and
the engines; and the control actor that `groupflow scale`, `status` and `stop` reach. Each is
stopped again by the caller's ExitStack should a later one fail to start.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial

from groupflow.actors.control import ActorInbox, limits_for, start_control
from groupflow.actors.generator import GeneratorPool, start_generator_pool
from groupflow.actors.learner import LearnerGroup
from groupflow.actors.placement import startup_placement
from groupflow.actors.reward import RewardPool, start_reward_pool
from groupflow.actors.starting import wait_started
from groupflow.actors.transport import WeightTransport
from groupflow.actors.transport_registry import make_transport
from groupflow.config import Config
from groupflow.core.recovery import RestartBudget
from groupflow.observe.progress import PhaseProgress


@dataclass
class JobActors:
    generators: GeneratorPool
    rewards: RewardPool
    learner: LearnerGroup
    transport: WeightTransport
    inbox: ActorInbox | None  # the control actor's; None when another job holds the run name


def start_actors(
    cfg: Config,
    model_path: str,
    restarts: RestartBudget,
    progress: PhaseProgress,
    undo: ExitStack,
) -> JobActors:
    """Start them all, each one's stop pushed on `undo`; `progress` says what is awaited."""
    generators = start_generator_pool(cfg, model_path, restarts)
    undo.callback(generators.shutdown)
    rewards = start_reward_pool(cfg)
    undo.callback(rewards.shutdown)
    placed = partial(
        startup_placement, cfg, generators.engines, rewards.workers, generators.tool_workers
    )
    progress.update(note="waiting for the learner ranks")
    learner = LearnerGroup(cfg, model_path, placed)
    undo.callback(learner.shutdown)
    for what, actors in (
        ("engine", generators.engines),
        ("reward worker", rewards.workers),
        ("tool worker", generators.tool_workers),
    ):
        wait_started(what, [a.__ray_ready__.remote() for a in actors], progress)
    control = start_control(cfg.trainer.run_name, limits_for(cfg))
    inbox = None if control is None else ActorInbox(control)
    if inbox is not None:
        undo.callback(inbox.close)
    transport = make_transport(
        cfg.rollout.weight_transport, learner, generators.engines, cfg.rollout.weight_bucket_mb
    )
    return JobActors(generators, rewards, learner, transport, inbox)
