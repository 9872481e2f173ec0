"""What every section shares: the one error a config problem raises, the `Section` base with its
rule for numbers, and Ray resources (each pool with defaults of its own)."""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, field_validator

from groupflow.core.errors import UserError
from groupflow.core.threads import actor_threads

# Every integer setting fits a signed 64-bit integer (what seeds and counts reach torch as).
INT64 = 1 << 63


class ConfigError(UserError, ValueError):
    """A config problem, phrased as one line that names the offending key."""


def _not_a_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("a boolean is not a number")
    return value


# The type of every float setting: what pydantic reads as a float (YAML 1.1 reads 1e-5 as a
# string), but never a boolean, which pydantic's lax float would read as 1.0. Every integer
# setting is pydantic's StrictInt: no boolean (`learner.lora.rank: true` was a rank-1 adapter),
# no float, no string. tests/unit/test_config.py walks the schema and holds every number
# setting, later ones included, to both.
FloatSetting = Annotated[float, BeforeValidator(_not_a_bool)]


def _unfit_number(value: Any) -> str | None:
    """Where in a setting's value a number is NaN, infinite or past 64 bits ('' = the value
    itself), or None when every number in it is fine."""
    if isinstance(value, float) and not math.isfinite(value):
        return ""
    if isinstance(value, int) and not isinstance(value, bool) and not -INT64 <= value < INT64:
        return ""
    if isinstance(value, BaseModel):  # a nested section checks its own settings
        return None
    items = value.items() if isinstance(value, dict) else None
    if isinstance(value, list | tuple):
        items = enumerate(value)
    for key, item in items or ():
        where = _unfit_number(item)
        if where is not None:
            return f"[{key!r}]{where}" if isinstance(key, str) else f"[{key}]{where}"
    return None


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # One rule for the whole schema, fields added later included: every number in a setting
    # (a float field, a tuple, a task's free-form options) is finite and fits 64 bits.
    @field_validator("*", mode="after")
    @classmethod
    def _finite_numbers(cls, value: Any) -> Any:
        where = _unfit_number(value)
        if where is not None:
            place = f" at {where}" if where else ""
            raise ValueError(f"numbers must be finite and fit in 64 bits{place}")
        return value


class Resources(Section):
    """Ray resources for one actor. CPU machines use fractional CPUs; GPU clusters set num_gpus."""

    num_cpus: FloatSetting = Field(
        1.0, ge=0, description="CPUs Ray reserves for the actor (fractions allowed)"
    )
    num_gpus: FloatSetting = Field(
        0.0, ge=0, description="GPUs Ray reserves for the actor; 0 = runs on CPU"
    )
    torch_threads: StrictInt | None = Field(
        None,
        ge=1,
        description="threads of the actor's process (torch's intra-op, OpenMP, MKL, the "
        "tokenizers); unset: the cores in cpu_cores, else num_cpus rounded down (at least 1)",
    )
    cpu_cores: list[Annotated[StrictInt, Field(ge=0)]] = Field(
        default_factory=list,
        description="cores the actor's threads are pinned to (os.sched_setaffinity; empty: "
        "not pinned), e.g. to keep generation and learning off each other's cores",
    )
    custom: dict[str, Annotated[FloatSetting, Field(ge=0)]] = Field(
        default_factory=dict,
        description="custom Ray resources, e.g. {groupflow_rollout: 1} to pin a worker group",
    )

    @property
    def threads(self) -> int:
        """The threads the actor runs (groupflow/core/threads.py): from its own resources, not
        the node's core count."""
        return actor_threads(self.num_cpus, self.cpu_cores, self.torch_threads)


# Each pool's defaults, as a Resources of its own: a `resources` setting given in part (e.g.
# only `custom`, to pin the pool to a worker group) keeps the pool's defaults for every key it
# leaves out, rather than Resources' 1 CPU, which would starve a CPU cluster of room.
class EngineResources(Resources):
    num_cpus: FloatSetting = Field(0.5, ge=0, description="CPUs Ray reserves for each engine")


class RewardWorkerResources(Resources):
    num_cpus: FloatSetting = Field(
        0.25, ge=0, description="CPUs Ray reserves for each reward worker"
    )


class LearnerRankResources(Resources):
    num_cpus: FloatSetting = Field(0.5, ge=0, description="CPUs Ray reserves for each learner rank")
