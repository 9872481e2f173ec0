"""A harness's trajectory (`agent.harness: module:name`, docs/agents.md): the user's agent code
run on one task row against its trajectory's own OpenAI-compatible endpoint
(rollout/endpoint.py), and what it trains on (rollout/harness_record.py).

The harness is called as `harness(row, endpoint)`: `row` is the task's prompt
(groupflow.core.records.Prompt: uid, text, messages, answer, task) and `endpoint` a
`HarnessEndpoint` (its `base_url` and `api_key`, the `model` name, and `client`, an
`openai.AsyncOpenAI` on them). It returns the text the verifier scores. An async harness runs
on the engine's event loop; a sync one in a thread (rollout/user_calls.py).

The contract is the environments' (rollout/trajectory.py): a harness that raises, returns
something that is not text, or makes no model call ends its trajectory `environment_error`;
one still running at `agent.deadline_s` is cancelled and ends `deadline`. Neither is the
model's failure: `Response.infra_failure` (harness_error, harness_deadline) masks it
(groupflow/loop/infra_failures.py). Its endpoint session closes when it ends, whatever the
end, so a harness left running cannot call on.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from groupflow.core.records import Prompt, Response
from groupflow.rollout.endpoint import Endpoint, EndpointLimits
from groupflow.rollout.shared_ssl import share_default_ssl_context
from groupflow.rollout.user_calls import USER_CALLS, UserCodeFailed

# in every engine, which imports this module (rollout/shared_ssl.py says why)
share_default_ssl_context()


@dataclass(frozen=True)
class HarnessEndpoint:
    """What a harness is given beside its task row: its trajectory's own endpoint."""

    base_url: str
    api_key: str
    model: str
    client: Any  # openai.AsyncOpenAI on base_url with api_key


async def run_harness(
    harness,
    prompt: Prompt,
    endpoint: Endpoint,
    limits: EndpointLimits,
    deadline_s: float,
    policy_version: int,
) -> Response:
    """One trajectory of `harness` on `prompt`: its recorded sequences as one Response (the
    latest call's sequence, the others in `earlier`), its answer the harness's return."""
    from openai import AsyncOpenAI

    session = endpoint.open(limits)
    base_url = endpoint.base_url(session)
    client = AsyncOpenAI(base_url=base_url, api_key=endpoint.key, max_retries=0, timeout=deadline_s)
    given = HarnessEndpoint(base_url, endpoint.key, endpoint.model, client)
    error = infra = None
    answer = ""
    try:
        ran = USER_CALLS.call(harness, prompt, given, culprit="agent.harness")
        answer = await asyncio.wait_for(ran, deadline_s)
        if not isinstance(answer, str):
            error = f"agent.harness returned a {type(answer).__name__}, not the text to score"
            infra, answer = "harness_error", ""
    except TimeoutError:  # the deadline's: one the harness raised is UserCodeFailed
        error, infra = (
            f"agent.harness ran past agent.deadline_s ({deadline_s:g}s)",
            "harness_deadline",
        )
    except UserCodeFailed as err:
        error, infra = f"agent.harness raised {err}", "harness_error"
    finally:
        endpoint.close(session)
        await client.close()
    record = session.record
    if infra is None and not record.segments:
        error, infra = "agent.harness made no model call", "harness_error"
    return harness_response(record.responses(), answer, error, infra, record.calls, policy_version)


def harness_response(
    sequences: list[Response],
    answer: str,
    error: str | None,
    infra: str | None,
    calls: int,
    policy_version: int,
) -> Response:
    if not sequences:
        sequences = [Response([], "", [], versions=[(policy_version, 0)], loss_mask=[])]
    *earlier, last = sequences
    last.earlier = earlier
    last.final_turn = answer
    last.turns = calls
    last.error = error
    last.infra_failure = infra
    last.end_reason = {
        None: "answer",
        "harness_error": "environment_error",
        "harness_deadline": "deadline",
    }[infra]
    return last
