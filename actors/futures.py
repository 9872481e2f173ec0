"""Ray as the job loop's `Futures` (groupflow.core.peers): handles are ObjectRefs."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import ray

from groupflow.actors.memory_kill import killed_for_memory, memory_kill_line
from groupflow.core.errors import CheckpointError
from groupflow.core.peers import PeerDied


class RayFutures:
    def wait_any(
        self, handles: Sequence[ray.ObjectRef], timeout: float | None = None
    ) -> list[ray.ObjectRef]:
        if not handles:
            time.sleep(timeout or 0.0)
            return []
        ready, _ = ray.wait(list(handles), num_returns=1, timeout=timeout)
        return ready

    def get(self, handles: Sequence[ray.ObjectRef]) -> list[Any]:
        try:
            return ray.get(list(handles))
        except (ray.exceptions.OutOfMemoryError, ray.exceptions.RayActorError) as err:
            if killed_for_memory(err):  # Ray's paragraph, in one line that names the setting
                raise PeerDied(memory_kill_line(err)) from err
            raise PeerDied(str(err).splitlines()[0]) from err
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, CheckpointError):  # a peer's one-line refusal, as itself
                raise err.cause from None
            raise
