"""The experts a mixture of experts routed each token to, captured inside vLLM's worker.

vLLM 0.32 returns routed experts (`enable_return_routed_experts`) only through its second model
runner, which needs Triton, which its CPU build lacks. Its routers take a capture callback
whatever the runner, though: this binds one to every MoE layer (vLLM's own binding,
`bind_routed_experts_capturer`), and after each forward files the step's rows under the
request and the position each token holds, which the runner's batch says. A position
computed again (a request preempted and recomputed after a weight load) keeps its latest
routing. `take` hands a finished request's routing over: (positions, layers, top-k), uint8
(uint16 past 256 experts), for every position the engine ran through the model, which is all
but the last sampled token. Layers without experts are zeros.

Runs in the worker process (rollout/weight_receiver.py mixes it in); no Ray.
"""

from __future__ import annotations

import numpy as np
import torch


class RoutingCapture:
    """The captured routing of the requests running, by vLLM's request id."""

    def __init__(self, layers: int, top_k: int, experts: int):
        self.shape = (layers, top_k)
        self.dtype = np.uint8 if experts <= 256 else np.uint16
        self.step: dict[int, torch.Tensor] = {}  # layer -> this forward's (tokens, k) ids
        # vLLM's request id -> (positions, their rows) of each forward that ran its tokens
        self.requests: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}

    def capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        """vLLM's router callback: layer `layer`'s expert ids of each token of the forward."""
        self.step[layer] = topk_ids

    def file_step(self, positions: np.ndarray, requests: list[str], counts: list[int]) -> None:
        """The forward's rows, laid out as the runner laid its requests' tokens out: counts[i]
        tokens of requests[i] after those of the requests before it, at `positions`."""
        n = sum(counts)
        rows = np.zeros((n, *self.shape), dtype=self.dtype)
        for layer, ids in self.step.items():
            rows[:, layer] = ids[:n].cpu().numpy()
        self.step = {}
        start = 0
        for request, count in zip(requests, counts, strict=True):
            if count:
                chunk = (positions[start : start + count], rows[start : start + count])
                self.requests.setdefault(request, []).append(chunk)
            start += count

    def take(self, request_id: str, n: int) -> list[np.ndarray | None]:
        """The routing of request `request_id`'s n samples (vLLM's own ids for them add a
        child index and a suffix), each removed from the capture."""
        out: list[np.ndarray | None] = [None] * n
        for internal in list(self.requests):
            index = _sample_of(internal, request_id, n)
            if index is not None:
                out[index] = self._assembled(self.requests.pop(internal))
        return out

    def _assembled(self, chunks: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        end = max(int(at.max()) for at, _ in chunks) + 1
        routing = np.zeros((end, *self.shape), dtype=self.dtype)
        for at, rows in chunks:  # in the order computed: a recomputation overwrites
            routing[at] = rows
        return routing


def _sample_of(internal: str, request_id: str, n: int) -> int | None:
    """The sample index of vLLM's request id `internal` within request `request_id`: vLLM
    names request "7" as "7-<suffix>", and its samples as "<i>_7-<suffix>" when n > 1."""
    base = internal.rsplit("-", 1)[0]
    if n == 1:
        return 0 if base == request_id else None
    index, _, rest = base.partition("_")
    return int(index) if rest == request_id and index.isdigit() else None


def capture_routing(model_runner) -> RoutingCapture:
    """Bind a capture to the routers of the runner's model and file each forward's rows."""
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
        bind_routed_experts_capturer,
    )

    config = model_runner.model_config
    capture = RoutingCapture(
        config.get_total_num_hidden_layers(),
        config.get_num_experts_per_tok(),
        config.get_num_experts(),
    )
    bind_routed_experts_capturer(model_runner.get_model(), capture)
    execute = model_runner.execute_model

    def execute_and_file(scheduler_output, *args, **kwargs):
        capture.step = {}
        out = execute(scheduler_output, *args, **kwargs)
        if capture.step:
            n = scheduler_output.total_num_scheduled_tokens
            batch = model_runner.input_batch
            requests = list(batch.req_ids[: batch.num_reqs])
            counts = [scheduler_output.num_scheduled_tokens.get(r, 0) for r in requests]
            # a copy: the runner reuses its positions buffer
            capture.file_step(model_runner.positions[:n].cpu().numpy().copy(), requests, counts)
        return out

    model_runner.execute_model = execute_and_file
    return capture
