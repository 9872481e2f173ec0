"""The `cluster` section: the Ray cluster the job runs on."""

from __future__ import annotations

from pydantic import Field, field_validator

from groupflow.config.base import FloatSetting, Section


class ClusterConfig(Section):
    """The Ray cluster the job runs on."""

    address: str | None = Field(
        None,
        description="Ray address of a cluster to drive the job from this process, in any form "
        "of docs/jobs.md's address rule (e.g. auto, HOST:6379, http://HEAD:8265) but ray:// "
        "(Ray Client: use groupflow submit); unset = $RAY_ADDRESS, else a local cluster",
    )
    num_cpus: FloatSetting | None = Field(
        None, gt=0, description="CPUs of a local cluster; unset = detected"
    )
    placement_timeout_s: FloatSetting = Field(
        300.0,
        gt=0,
        le=86_400,
        allow_inf_nan=False,
        description="seconds every actor the job starts with may wait for a node before the "
        "job fails, naming the pool that was not placed (raise it where an autoscaler adds "
        "nodes slowly)",
    )

    @field_validator("address")
    @classmethod
    def _not_ray_client(cls, address: str | None) -> str | None:
        refusal = ray_client_refusal(address)
        if refusal is not None:
            raise ValueError(refusal)
        return address


def ray_client_refusal(address: str | None) -> str | None:
    """Why a job cannot be driven from `address`, when it is a Ray Client one (ray://): the
    weights reach the engines through streaming actor methods, which Ray Client does not
    carry, so such a job would train up to its first weight sync and then crash."""
    if address is None or not address.strip().lower().startswith("ray://"):
        return None
    return (
        f"{address} is a Ray Client address, and a job cannot be driven through Ray Client "
        "(its streaming actor methods, which carry the weights to the engines, are not "
        "supported there); run it on the cluster with `groupflow submit --address "
        "http://HEAD:8265`"
    )
