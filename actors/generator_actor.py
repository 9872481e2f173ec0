"""The generator actor, in the engine's process: a vLLM engine (rollout/engine.py) that samples
groups, a request each, and loads new weights while it runs. The pool that spreads a rollout
over these actors, in the driver's process, is actors/generator.py.

Weights arrive by the job's transport (actors/transport.py): its engine-side steps run here
through `weight_sync`. A chunk sent to an engine after a weight load starts once that load is
done (`sample`'s `min_version`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Callable

from groupflow.actors.affinity import pin_to_cores
from groupflow.actors.tools import ToolPoolClient
from groupflow.actors.transport import SyncHost
from groupflow.config import SamplingConfig
from groupflow.core.device import Device
from groupflow.core.records import Prompt, SampledGroup
from groupflow.rollout.engine import EngineSettings, RolloutEngine


class Generator(SyncHost):
    """An async actor: every call runs in its event loop, so chunks generate side by side (each
    group a request of its own, batched continuously by vLLM) while weights arrive and load.

    Ray starts an async actor's calls in no guaranteed order, so a chunk says which weights it
    needs: `sample` waits until the engine holds version `min_version` (the newest the job had
    sent when it sent the chunk), or a load has ended since the chunk arrived (a failed load,
    or one that took the engine back to an older version after the learner was rebuilt from a
    checkpoint: the group then carries the version that sampled it, and the prompt stream
    drops it if the learner does not hold that version's successors)."""

    def __init__(
        self, settings: EngineSettings, device: Device, cores: list[int], tool_workers: list
    ):
        pin_to_cores(cores)  # before vLLM starts its threads, which inherit it
        run_code = ToolPoolClient(tool_workers).run if tool_workers else None
        self.engine = RolloutEngine(settings, run_code)
        self.device = device
        self._loads_ended = 0  # weight loads done (loaded or failed)
        self._load_ended = asyncio.Condition()

    async def sample(
        self,
        prompts: list[Prompt],
        group_size: int,
        sampling: SamplingConfig,
        min_version: int = 0,
    ) -> list[SampledGroup]:
        await self._holds(min_version)
        return await asyncio.gather(
            *(self.engine.sample_group(p, group_size, sampling) for p in prompts)
        )

    async def complete(
        self,
        prompts: list[Prompt],
        n: int,
        sampling: SamplingConfig,
        greedy: bool,
        min_version: int = 0,
    ) -> list[SampledGroup]:
        await self._holds(min_version)
        return await self.engine.complete(prompts, n, sampling, greedy)

    async def warm_up(self, group_size: int, sampling: SamplingConfig) -> None:
        """Sample once, so that a new engine's first real chunk is not slowed by the engine's
        first-call costs (seconds on CPU), which would hold up the whole step."""
        await self.sample([Prompt("warm-up", "1+1=", 2)] * 2, group_size, sampling)

    async def _holds(self, version: int) -> None:
        ended = self._loads_ended
        async with self._load_ended:
            await self._load_ended.wait_for(
                lambda: self.engine.policy_version >= version or self._loads_ended > ended
            )

    async def weight_sync(self, step: Callable, *args):
        """Run a weight transport's engine-side `step` here, `step(self, *args)`, awaited
        where it is a coroutine (actors/transport.py: a transport's steps, and what of this
        actor they use: `engine`, `device`, `loading` and `sync_state`)."""
        done = step(self, *args)
        return await done if inspect.isawaitable(done) else done

    @contextlib.asynccontextmanager
    async def loading(self):
        """Around a weight load: once it ends, loaded or failed, the chunks that wait for it
        sample (`_holds`)."""
        try:
            yield
        finally:
            # A failed load too: the chunks waiting for it sample with the weights there are
            # (their groups carry that version: staleness decides what is trained on).
            async with self._load_ended:
                self._loads_ended += 1
                self._load_ended.notify_all()

    async def parameters_snapshot(self) -> dict:
        return await self.engine.parameters_snapshot()
