"""A vLLM engine for grouped sampling: one request with n = G per prompt, batched continuously,
weights loaded while requests run.

No Ray in here; actors/generator_actor.py wraps it and calls it from the actor's event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING

import torch

from groupflow.core.adapters import (
    ADAPTER_ID,
    ADAPTER_NAME,
    engine_max_rank,
    serving_config,
)
from groupflow.core.model_dir import read_model_config
from groupflow.core.records import Prompt, Response, SampledGroup
from groupflow.core.sync_probe import Probe, ProbeLogprobs, job_probe
from groupflow.core.weight_format import (
    LoadedWeights,
    WeightSyncMismatch,
    WorkerLoad,
    checksums,
)
from groupflow.rollout.agent import Agent, AgentSettings
from groupflow.rollout.endpoint import Endpoint, EndpointLimits
from groupflow.rollout.harness import run_harness
from groupflow.rollout.prompt_render import ChatSettings, PromptRenderer, check_prompt_lengths
from groupflow.rollout.python_tool import RunCode
from groupflow.rollout.shard_stream import ShardSender
from groupflow.rollout.tp_shards import ModelShape, shard_plan
from groupflow.rollout.weight_intake import checksummed

if TYPE_CHECKING:
    from groupflow.config.rollout import SamplingConfig


@dataclass
class EngineSettings:
    model_path: str
    dtype: str = "float32"
    max_model_len: int = 256
    kv_cache_gib: float = 1.0
    gpu_memory_utilization: float = 0.5
    seed: int = 0
    chat: ChatSettings = field(default_factory=ChatSettings)
    enforce_eager: bool = True
    max_num_seqs: int | None = None  # None: vLLM's default
    enable_prefix_caching: bool | None = None  # None: vLLM's default
    tensor_parallel_size: int = 1
    partial_rollout: bool = True  # a sync loads while requests run (RolloutEngine.load_weights)
    lora: EngineLora | None = None  # serve a LoRA adapter: syncs carry the adapter only
    agent: AgentSettings | None = None  # multi-turn trajectories with tools (rollout/agent.py)
    # the job's seed, from which the engine draws the sync probe it scores after each load
    # (groupflow/core/sync_probe.py); None: no probe
    sync_probe_seed: int | None = None
    # return each token's experts per layer with the response (learner.moe.routing_replay)
    routed_experts: bool = False


@dataclass
class EngineLora:
    """The adapter an engine serves (groupflow/core/adapters.py): its LoRA slot's rank and the
    adapter's PEFT config."""

    max_rank: int
    config: dict


def resolved_enforce_eager(enforce_eager: bool | None, num_gpus: float) -> bool:
    """rollout.enforce_eager: unset, eager on CPU (no CUDA graphs to capture, and compiling the
    model would cost each engine minutes at start) and CUDA graphs on GPUs."""
    return num_gpus == 0 if enforce_eager is None else enforce_eager


def engine_settings(cfg, model_path: str, seed: int) -> EngineSettings:
    """The engine part of a job config (groupflow.config.Config)."""
    lora = cfg.learner.lora
    capture = cfg.learner.moe.routing_replay != "off"  # 'rollout' replays it, 'observe' compares
    return EngineSettings(
        model_path=model_path,
        dtype=cfg.model.dtype,
        max_model_len=cfg.rollout.max_model_len,
        kv_cache_gib=cfg.rollout.kv_cache_gib,
        gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
        seed=seed,
        chat=ChatSettings(cfg.task.chat_template, cfg.task.system_prompt),
        # the routing capture's callbacks run in Python, which a CUDA graph's replay skips
        enforce_eager=capture
        or resolved_enforce_eager(cfg.rollout.enforce_eager, cfg.rollout.resources.num_gpus),
        max_num_seqs=cfg.rollout.max_num_seqs,
        enable_prefix_caching=cfg.rollout.enable_prefix_caching,
        tensor_parallel_size=cfg.rollout.tensor_parallel_size,
        partial_rollout=cfg.rollout.partial_rollout,
        lora=None if lora is None else EngineLora(engine_max_rank(lora.rank), serving_config(lora)),
        agent=AgentSettings.of(cfg) if cfg.multi_turn else None,
        sync_probe_seed=cfg.trainer.seed,
        routed_experts=capture,
    )


def cpu_threads_bind(cores: list[int], workers: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `workers` tensor-parallel CPU workers: the cores this
    process may run on, split into that many runs of neighbours ("0,1|2,3"). vLLM's own
    choice binds each worker to a NUMA node of its own, which a one-node machine lacks."""
    if len(cores) < workers:
        raise ValueError(
            f"rollout.tensor_parallel_size: {workers} CPU workers need as many cores; this "
            f"engine may run on {len(cores)} ({cores})"
        )
    share, extra = divmod(len(cores), workers)
    runs, start = [], 0
    for worker in range(workers):
        end = start + share + (worker < extra)
        runs.append(",".join(str(c) for c in cores[start:end]))
        start = end
    return "|".join(runs)


class RolloutEngine:
    """vLLM's engine, driven request by request: every group is a request of its own, batched
    continuously with whatever else the engine runs, and a sync loads while requests run.

    The engine core lives in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so that a sync's
    tensors reach vLLM's worker as tensors, consumed as they arrive; vLLM's async engine would
    put the core in a process of its own, which costs an engine twice its start time and the
    sync a copy through a socket. One thread makes every call into vLLM, one at a time (`_call`),
    stepping the engine while requests are open; the async methods are for the caller's event
    loop. A weight load is such a call: the requests stop for it, between two steps."""

    def __init__(self, settings: EngineSettings, run_code: RunCode | None = None):
        """run_code: where the python tool runs its sandboxes (actors/tools.py)."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(settings.kv_cache_gib))))
        from vllm import LLM
        from vllm.platforms import current_platform

        tp = settings.tensor_parallel_size
        if tp > 1 and current_platform.is_cpu() and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            cores = sorted(os.sched_getaffinity(0))
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(cores, tp)
        self.tensor_parallel_size = tp
        self.model_shape = ModelShape.of(read_model_config(settings.model_path)) if tp > 1 else None

        self.llm = LLM(
            model=settings.model_path,
            dtype=settings.dtype,
            max_model_len=settings.max_model_len,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            seed=settings.seed,
            enforce_eager=settings.enforce_eager,
            tensor_parallel_size=tp,
            distributed_executor_backend="mp" if tp > 1 else None,
            # None: vLLM's own default for the device.
            max_num_seqs=settings.max_num_seqs,
            # A cached prefix is not run through the model, so its tokens' routing would not
            # be captured: none is cached where the routing returns.
            enable_prefix_caching=False
            if settings.routed_experts
            else settings.enable_prefix_caching,
            # vLLM's CPU sampler cannot rewind a seeded request's random stream, which a
            # prefill split over steps needs: requests that arrive while others run would
            # split theirs. GPUs keep chunked prefill.
            enable_chunked_prefill=False if current_platform.is_cpu() else None,
            # Log-probs after temperature: the same distribution the learner recomputes.
            logprobs_mode="processed_logprobs",
            worker_extension_cls="groupflow.rollout.weight_receiver.WeightReceiver",
            # One adapter slot: a sync replaces the adapter in place (load_weights).
            **(
                {}
                if settings.lora is None
                else dict(enable_lora=True, max_loras=1, max_lora_rank=settings.lora.max_rank)
            ),
        )
        self.routed_experts = settings.routed_experts
        if settings.routed_experts:
            self.llm.collective_rpc("start_routing_capture")
        self.lora = settings.lora
        # The adapter requests carry once one is loaded; before that the engine serves the
        # base model, which is the policy's first version (an adapter starts at B = 0).
        self._lora_request = None
        self.tokenizer = self.llm.get_tokenizer()
        self.agent = None if settings.agent is None else Agent(settings.agent, run_code)
        chat = settings.chat if self.agent is None else self.agent.chat(settings.chat)
        self.renderer = PromptRenderer(self.tokenizer, chat)
        self._chat = chat
        self._model_name = os.path.basename(os.path.normpath(settings.model_path))
        self._endpoint: Endpoint | None = None  # a harness job's, started with its first trajectory
        self._endpoint_started: asyncio.Future | None = None
        if self.agent is not None:
            self.agent.start(self.renderer)
        self.max_model_len = settings.max_model_len
        self.partial_rollout = settings.partial_rollout
        self.sync_probe: Probe | None = None
        if settings.sync_probe_seed is not None:
            self.sync_probe = job_probe(
                settings.model_path, settings.sync_probe_seed, settings.max_model_len
            )
        self.policy_version = 0
        self._vllm_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm")
        self._open: dict[str, asyncio.Future] = {}  # request id -> its final output, to come
        self._stepping: asyncio.Task | None = None
        self._admitting = asyncio.Event()  # cleared while a load waits for requests to end
        self._admitting.set()
        self._requests = itertools.count()

    async def sample_group(
        self, prompt: Prompt, group_size: int, sampling: SamplingConfig
    ) -> SampledGroup:
        """G sampled responses to `prompt` (G trajectories in a multi-turn job), with their
        token ids, log-probs and the policy version of each token."""
        from vllm import SamplingParams

        def params(n: int, key: str, max_tokens: int) -> SamplingParams:
            return SamplingParams(
                n=n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                min_p=sampling.min_p,
                max_tokens=max_tokens,
                stop=sampling.stop,
                include_stop_str_in_output=True,
                ignore_eos=sampling.ignore_eos,
                seed=request_seed(sampling.seed, key, self.policy_version),
                logprobs=0,
            )

        max_tokens = prompt.max_tokens or sampling.max_tokens
        if self.agent is not None:
            return await self._trajectories(prompt, group_size, params, max_tokens)
        return await self._generate(prompt, params(group_size, prompt.uid, max_tokens), max_tokens)

    async def complete(
        self, prompts: list[Prompt], n: int, sampling: SamplingConfig, greedy: bool
    ) -> list[SampledGroup]:
        """Held-out evaluation: one greedy answer per prompt (trajectory, in a multi-turn
        job), or n sampled ones."""
        from vllm import SamplingParams

        if not greedy:
            return await asyncio.gather(*(self.sample_group(p, n, sampling) for p in prompts))

        def params(n: int, key: str, max_tokens: int) -> SamplingParams:
            # the training responses' ends (stop strings), not their randomness
            return SamplingParams(
                n=n,
                temperature=0.0,
                max_tokens=max_tokens,
                stop=sampling.stop,
                include_stop_str_in_output=True,
            )

        def one(prompt: Prompt):
            max_tokens = prompt.max_tokens or sampling.max_tokens
            if self.agent is not None:
                return self._trajectories(prompt, 1, params, max_tokens)
            return self._generate(prompt, params(1, prompt.uid, max_tokens), max_tokens)

        return await asyncio.gather(*(one(p) for p in prompts))

    def _prompt_ids(self, prompt: Prompt, max_tokens: int) -> list[int]:
        ids = self.renderer.ids(prompt)
        # The driver measured every prompt it could draw before the job started; this guard
        # keeps any other prompt (a caller's own) from reaching vLLM, which would fail on it.
        check_prompt_lengths([prompt], [len(ids)], self.max_model_len, max_tokens)
        return ids

    async def _generate(self, prompt: Prompt, params, max_tokens: int) -> SampledGroup:
        ids = self._prompt_ids(prompt, max_tokens)
        out, submitted_at = await self._request(ids, params)
        return _group(prompt, ids, [_response(c, submitted_at) for c in out.outputs])

    async def _trajectories(self, prompt: Prompt, n: int, params, max_tokens: int):
        """n trajectories from `prompt`, each turn a request of its own (rollout/agent.py)."""
        ids = self._prompt_ids(prompt, max_tokens)
        if self.agent.harness is not None:
            return await self._harness_trajectories(prompt, ids, n, params, max_tokens)

        def turn_of(j: int):
            async def generate(ids_so_far: list[int], turn_tokens: int, turn: int) -> Response:
                key = f"{prompt.uid}/{j}/{turn}"
                turn_params = params(1, key, turn_tokens)
                # some models' call markers are special tokens: decoded as the parser asks
                turn_params.skip_special_tokens = self.agent.parser.skip_special_tokens
                out, submitted_at = await self._request(ids_so_far, turn_params)
                return self._turn(out.outputs[0], submitted_at)

            return generate

        responses = await asyncio.gather(
            *(
                self.agent.trajectory(prompt, ids, turn_of(j), max_tokens, self.max_model_len)
                for j in range(n)
            )
        )
        return _group(prompt, ids, list(responses))

    async def _harness_trajectories(
        self, prompt: Prompt, ids: list[int], n: int, params, max_tokens: int
    ) -> SampledGroup:
        """n trajectories of the job's harness on `prompt`, each calling the engine through its
        own session of the engine's endpoint (rollout/harness.py)."""
        if self._endpoint is None:  # one endpoint, however many chunks arrive at once
            self._endpoint = Endpoint(
                self._serve_call, self._harness_renderer, self.agent.parser, self._model_name
            )
            self._endpoint_started = asyncio.ensure_future(self._endpoint.start())
        await asyncio.shield(self._endpoint_started)
        job = params(1, prompt.uid, max_tokens)  # the job's sampling, where a call sets none
        defaults = {k: getattr(job, k) for k in ("temperature", "top_p", "top_k", "min_p")}
        limits = EndpointLimits(
            self.agent.settings.max_turns, max_tokens, self.max_model_len, defaults
        )
        responses = await asyncio.gather(
            *(
                run_harness(
                    self.agent.harness,
                    prompt,
                    self._endpoint,
                    limits,
                    self.agent.settings.deadline_s,
                    self.policy_version,
                )
                for _ in range(n)
            )
        )
        return _group(prompt, ids, list(responses))

    def _harness_renderer(self, tools: list[dict] | None) -> PromptRenderer:
        """The job's chat template declaring a harness call's tools; the harness writes its own
        system prompt."""
        return PromptRenderer(self.tokenizer, replace(self._chat, system_prompt=None, tools=tools))

    async def _serve_call(self, ids: list[int], params) -> list[Response]:
        """One endpoint call (rollout/endpoint.py): a request on exactly `ids`."""
        out, submitted_at = await self._request(ids, params)
        return [self._turn(c, submitted_at) for c in out.outputs]

    def _turn(self, completion, submitted_at: int) -> Response:
        response = _response(completion, submitted_at)
        response.text = self._without_end_of_text(completion)
        return response

    def _without_end_of_text(self, completion) -> str:
        """A turn's text less the end-of-text token that ended it, which vLLM keeps in the text
        when special tokens are kept (include_stop_str_in_output): no part of what the model
        said."""
        text = completion.text
        if completion.finish_reason == "stop" and completion.stop_reason is None:
            end = self.tokenizer.decode(completion.token_ids[-1:])  # vLLM: None for an EOS
            if end and text.endswith(end):
                return text[: -len(end)]
        return text

    async def _request(self, ids: list[int], params):
        """One vLLM request on `ids`: its final output, and the version the engine held when
        it was submitted."""
        from vllm.sampling_params import RequestOutputKind

        params.output_kind = RequestOutputKind.FINAL_ONLY  # the G responses at once
        await self._admitting.wait()
        submitted_at = self.policy_version
        request = str(next(self._requests))
        final = asyncio.get_running_loop().create_future()
        self._open[request] = final
        try:
            await self._call(
                partial(self.llm.llm_engine.add_request, lora_request=self._lora_request),
                request,
                {"prompt_token_ids": ids},
                params,
            )
        except BaseException:
            del self._open[request]
            raise
        if self._stepping is None or self._stepping.done():
            self._stepping = asyncio.create_task(self._step_while_open())
        return await final, submitted_at

    async def _step_while_open(self) -> None:
        try:
            while self._open:
                for out in await self._call(self.llm.llm_engine.step):
                    final = self._open.pop(out.request_id, None) if out.finished else None
                    if final is not None:
                        if self.routed_experts:
                            await self._attach_routing(out)
                        final.set_result(out)
        except BaseException as err:  # the engine failed: so did every open request
            open_requests, self._open = self._open, {}
            for final in open_requests.values():
                final.set_exception(err)
            raise

    async def _attach_routing(self, out) -> None:
        """Each sample's routing (rollout/routing_capture.py) on its completion, as vLLM's
        own `routed_experts` would be; the first tensor-parallel worker's (all route alike)."""
        take = partial(
            self.llm.collective_rpc, "take_routing", args=(out.request_id, len(out.outputs))
        )
        routing = (await self._call(take))[0]
        for completion in out.outputs:
            # none past the tokens kept: a token a stop string cut off may have run already
            ran = len(out.prompt_token_ids) + len(completion.token_ids) - 1
            routed = routing[completion.index]
            completion.routed_experts = None if routed is None else routed[:ran]

    async def _call(self, fn: Callable, *args):
        """`fn(*args)` in the one thread that calls into vLLM, after the calls before it."""
        return await asyncio.get_running_loop().run_in_executor(self._vllm_thread, fn, *args)

    async def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int):
        """Load sync `version` (load_weights) between two engine steps. With partial rollouts
        the running requests go on under the new weights, their key-value caches computed
        again; without, they finish first and new ones wait for the load."""
        if not self.partial_rollout:
            self._admitting.clear()
        try:
            while not self.partial_rollout and self._open:
                await asyncio.sleep(0.01)  # the stepping task ends the open requests
            loaded = await self._call(self.load_weights, named_tensors, version)
        finally:
            self._admitting.set()
        if self.sync_probe is not None:
            loaded.probe = await self._score_probe(version)
        return loaded

    async def _score_probe(self, version: int) -> ProbeLogprobs | None:
        """The engine's log-probs (temperature 1) of each token of the sync probe after its
        first, each sequence a request batched with whatever else runs (its prefill and
        nothing more); None where another load landed before they were all scored."""
        from vllm import SamplingParams

        def params() -> SamplingParams:
            return SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)

        scored = await asyncio.gather(*(self._request(ids, params()) for ids in self.sync_probe))
        # vLLM labels each sampled token with the version that sampled it; the prefill that
        # scored a sequence sampled its one token in the same engine step.
        labels = {s.version for out, _ in scored for s in out.outputs[0].weight_versions or []}
        if self.policy_version != version or labels - {str(version)}:
            return None
        return [
            [step[t].logprob for step, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
            for (out, _), ids in zip(scored, self.sync_probe, strict=True)
        ]

    def load_weights(self, named_tensors, version: int) -> LoadedWeights:
        """Load (name, tensor) pairs in place: a list, or an iterator that yields them as they
        arrive (the engine lives in this process, so the worker consumes it lazily). Returns
        the checksum of every tensor loaded (groupflow/core/weight_format.py). Called from the
        thread that calls into vLLM (`load`), or where no request runs."""
        loaded = LoadedWeights(version)
        if self.lora is not None:
            # The adapter is a few MB: handed over whole (its many small matrices checksummed
            # together), and swapped in between two steps.
            pairs = list(named_tensors)
            loaded.checksums.update(checksums((name, t, 0) for name, t in pairs))
            self.llm.collective_rpc("load_adapter", args=(pairs, self.lora.config))
            self._lora_request = _policy_adapter()
        else:
            pairs = checksummed(named_tensors, loaded.checksums)
            if self.tensor_parallel_size > 1:
                loaded.workers = self._load_by_shard(pairs, version)
            else:
                self.llm.collective_rpc("load_named_tensors", args=(pairs,))
        engine = self.llm.llm_engine
        # Tokens sampled from here on carry the new version (vLLM labels each one), and no
        # key-value cache the old weights computed is used again: running requests compute
        # theirs anew (vLLM preempts them), cached prefixes are dropped.
        engine.set_weight_version(str(version))
        engine.reset_prefix_cache(reset_running_requests=True)
        self.policy_version = version
        return loaded

    def _load_by_shard(self, pairs, version: int) -> list[WorkerLoad]:
        """Load `pairs` on the tensor-parallel workers, other processes: each receives its own
        part of each tensor only, as the pairs arrive (rollout/shard_stream.py), while vLLM's
        call into every worker runs in a thread of its own. Raises WeightSyncMismatch where a
        worker received other bytes than the engine sent it."""
        tp = self.tensor_parallel_size
        ended: dict[str, object] = {}

        def load_on_workers():
            try:
                ended["result"] = self.llm.collective_rpc("load_shards", args=(sender.address,))
            except BaseException as err:  # raised below, in the caller's thread
                ended["error"] = err

        with ShardSender(tp) as sender:
            workers = threading.Thread(target=load_on_workers, name="shard-load", daemon=True)
            workers.start()
            try:
                sender.accept(workers.is_alive)
                sender.send(
                    pairs, lambda name, shape: shard_plan(name, shape, self.model_shape, tp)
                )
            except ConnectionError:
                # a worker failed its load: its error, not the closed socket, says why
                sender.close()
                workers.join()
                if "error" in ended:
                    raise ended["error"] from None
                raise
            except BaseException:
                sender.close()  # the workers' streams end: they fail their loads, and restore
                workers.join()
                raise
            workers.join()
        if "error" in ended:
            raise ended["error"]
        loads = []
        for (load, received), sent in zip(ended["result"], sender.sent, strict=True):
            for name in sorted(sent.keys() | received.keys()):
                if sent.get(name) != received.get(name):
                    raise WeightSyncMismatch(
                        f"weight sync {version}: tensor-parallel worker {load.rank} received "
                        f"other bytes of {name} than the engine sent it"
                    )
            loads.append(load)
        return loads

    async def parameters_snapshot(self) -> dict:
        return (await self._call(self.llm.collective_rpc, "named_parameters_snapshot"))[0]


def _group(prompt: Prompt, ids: list[int], responses: list[Response]) -> SampledGroup:
    """The group of `responses`, labelled with the version of its oldest token."""
    # a harness trajectory's earlier sequences (split off) are older than its last
    parts = [part for r in responses for part in (*r.earlier, r)]
    return SampledGroup(prompt, ids, responses, min(p.versions[0][0] for p in parts))


def _policy_adapter():
    from vllm.lora.request import LoRARequest

    # The path is never read: the adapter is registered under this id from memory before any
    # request names it (rollout/weight_receiver.py `load_adapter`).
    return LoRARequest(ADAPTER_NAME, ADAPTER_ID, lora_path="groupflow:in-memory")


def _response(completion, submitted_at: int) -> Response:
    # vLLM labels each token with the version set when it was sampled; "default" is the
    # engine's label before its first sync, which the request's submission version names.
    spans = completion.weight_versions or []
    versions = [
        (submitted_at if s.version == "default" else int(s.version), s.start)
        for s in spans
        if s.end > s.start
    ]
    return Response(
        token_ids=list(completion.token_ids),
        text=completion.text,
        logprobs=_sampled_logprobs(completion),
        finish_reason=completion.finish_reason,
        versions=versions or [(submitted_at, 0)],
        routed_experts=completion.routed_experts,
    )


def request_seed(seed: int | None, uid: str, version: int) -> int | None:
    """A request's own seed: the same prompt at the same policy version samples the same
    responses in any run, on any engine; a new version or another prompt gets fresh ones."""
    if seed is None:
        return None
    return zlib.crc32(f"{seed}/{uid}/{version}".encode())


def _sampled_logprobs(completion) -> list[float]:
    if completion.logprobs is None:
        return []
    return [
        step[tok].logprob
        for tok, step in zip(completion.token_ids, completion.logprobs, strict=True)
    ]
