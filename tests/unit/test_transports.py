"""The weight transports' table (actors/transport_registry.py) against the config that names
them, and a transport's engine side on a stand-in actor, without Ray."""

from __future__ import annotations

import asyncio
import contextlib
import typing
from types import SimpleNamespace

import pytest

from groupflow.actors.control import limits_for
from groupflow.actors.transport import SyncHost
from groupflow.actors.transport_object_store import Streams, load_streamed, receive_part
from groupflow.actors.transport_registry import TRANSPORTS, transport_class
from groupflow.config import ConfigError, RolloutConfig
from groupflow.run.job_config import build_config

AUTOSCALE = "rollout.autoscale={min_engines: 1, max_engines: 2}"


def test_the_config_names_exactly_the_registered_transports():
    """A new transport is a file and a line in TRANSPORTS: this fails until the config's
    Literal names it too (and until a transport the config names is registered)."""
    literal = RolloutConfig.model_fields["weight_transport"].annotation
    assert set(typing.get_args(literal)) == set(TRANSPORTS)
    assert RolloutConfig().weight_transport in TRANSPORTS


@pytest.mark.parametrize("name", sorted(TRANSPORTS))
def test_what_a_job_may_change_follows_the_transport(name):
    """Autoscaling, `groupflow scale --engines` and engine replacement need a transport whose
    members may change; the config's check and the scale limits agree with the table."""
    elastic = TRANSPORTS[name].elastic
    cfg = build_config({}, [f"rollout.weight_transport={name}"])
    assert limits_for(cfg).engines_scalable is elastic
    assert limits_for(cfg).transport == name
    if elastic:
        build_config({}, [f"rollout.weight_transport={name}", AUTOSCALE])
    else:
        with pytest.raises(ConfigError, match="autoscale: needs weight_transport"):
            build_config({}, [f"rollout.weight_transport={name}", AUTOSCALE])


def test_an_unknown_transport_is_one_line_naming_the_key():
    with pytest.raises(ValueError, match=r"^rollout.weight_transport: unknown transport 'pigeon'$"):
        transport_class("pigeon")


class StandInEngine(SyncHost):
    """What a transport's engine-side steps use of the generator actor: `engine`, `device`,
    `loading`; the engine's load consumes the pairs as vLLM would."""

    def __init__(self):
        self.device = SimpleNamespace(kind="cpu")
        self.loads_ended = 0
        self.engine = SimpleNamespace(load=self._load)

    async def _load(self, pairs, version):
        return [name for name, _ in pairs], version

    @contextlib.asynccontextmanager
    async def loading(self):
        try:
            yield
        finally:
            self.loads_ended += 1


def test_an_engine_abandons_a_streamed_sync_whose_rank_died_and_lets_its_late_parts_go():
    """The object-store transport's engine side: a rank's push that fails ends the load with
    None (the learner's failure, not the engine's), the load counts as ended (chunks waiting
    for it go on), and a part of that sync arriving late is let go."""

    async def run():
        actor = StandInEngine()
        dead_rank = asyncio.get_running_loop().create_future()
        dead_rank.set_exception(RuntimeError("a learner rank died"))
        buckets = [[("w", (2,), "float32")]]
        loaded = await load_streamed(actor, buckets, 3, "sync-a", [dead_rank])
        await receive_part(actor, "sync-a", 0, 0, ["late"])
        return actor, loaded

    actor, loaded = asyncio.run(run())
    assert loaded is None and actor.loads_ended == 1
    streams = actor.sync_state(Streams)
    assert streams.arriving == {} and streams.ended == {"sync-a"}
