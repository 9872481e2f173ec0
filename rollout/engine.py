"""A vLLM engine for grouped sampling: one request with n = G per prompt.

No Ray in here; actors/generator.py wraps it. The engine core lives in the caller's process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so that weights can be swapped in place: in its one worker,
or, tensor-parallel, in worker processes of vLLM's multiprocess executor, one per shard.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from groupflow.records import Prompt, Response, SampledGroup
from groupflow.rollout.prompt_render import ChatSettings, PromptRenderer, check_prompt_lengths
from groupflow.rollout.weight_intake import broadcast, checksummed
from groupflow.weight_format import Broadcaster, LoadedWeights, Manifest

if TYPE_CHECKING:
    from groupflow.config import SamplingConfig


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


def resolved_enforce_eager(enforce_eager: bool | None, num_gpus: float) -> bool:
    """rollout.enforce_eager: unset, eager on CPU (no CUDA graphs to capture, and compiling the
    model would cost each engine minutes at start) and CUDA graphs on GPUs."""
    return num_gpus == 0 if enforce_eager is None else enforce_eager


def engine_settings(cfg, model_path: str, seed: int) -> EngineSettings:
    """The engine part of a job config (groupflow.config.Config)."""
    return EngineSettings(
        model_path=model_path,
        dtype=cfg.model.dtype,
        max_model_len=cfg.rollout.max_model_len,
        kv_cache_gib=cfg.rollout.kv_cache_gib,
        gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
        seed=seed,
        chat=ChatSettings(cfg.task.chat_template, cfg.task.system_prompt),
        enforce_eager=resolved_enforce_eager(
            cfg.rollout.enforce_eager, cfg.rollout.resources.num_gpus
        ),
        max_num_seqs=cfg.rollout.max_num_seqs,
        enable_prefix_caching=cfg.rollout.enable_prefix_caching,
        tensor_parallel_size=cfg.rollout.tensor_parallel_size,
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
    def __init__(self, settings: EngineSettings):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(settings.kv_cache_gib))))
        from vllm import LLM
        from vllm.platforms import current_platform

        tp = settings.tensor_parallel_size
        if tp > 1 and current_platform.is_cpu() and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            cores = sorted(os.sched_getaffinity(0))
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(cores, tp)
        self.tensor_parallel_size = tp

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
            enable_prefix_caching=settings.enable_prefix_caching,
            # Log-probs after temperature: the same distribution the learner recomputes.
            logprobs_mode="processed_logprobs",
            worker_extension_cls="groupflow.rollout.weight_receiver.WeightReceiver",
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.renderer = PromptRenderer(self.tokenizer, settings.chat)
        self.max_model_len = settings.max_model_len
        self.policy_version = 0

    def sample_groups(
        self, prompts: list[Prompt], group_size: int, sampling: SamplingConfig
    ) -> list[SampledGroup]:
        """G sampled responses for each prompt, with their token ids and log-probs."""
        from vllm import SamplingParams

        def params(prompt: Prompt) -> SamplingParams:
            return SamplingParams(
                n=group_size,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                min_p=sampling.min_p,
                max_tokens=prompt.max_tokens or sampling.max_tokens,
                stop=sampling.stop,
                include_stop_str_in_output=True,
                seed=request_seed(sampling.seed, prompt.uid, self.policy_version),
                logprobs=0,
            )

        return self._generate(prompts, [params(p) for p in prompts], sampling.max_tokens)

    def complete(
        self, prompts: list[Prompt], n: int, sampling: SamplingConfig, greedy: bool
    ) -> list[SampledGroup]:
        """Held-out evaluation: one greedy answer per prompt, or n sampled ones."""
        from vllm import SamplingParams

        if greedy:
            params = [
                SamplingParams(n=1, temperature=0.0, max_tokens=p.max_tokens or sampling.max_tokens)
                for p in prompts
            ]
            return self._generate(prompts, params, sampling.max_tokens)
        return self.sample_groups(prompts, n, sampling)

    def _generate(self, prompts: list[Prompt], params, max_tokens: int) -> list[SampledGroup]:
        prompt_ids = [self.renderer.ids(p) for p in prompts]
        # The driver measured every prompt it could draw before the job started; this guard
        # keeps any other prompt (a caller's own) from reaching vLLM, which would fail on it.
        check_prompt_lengths(
            prompts, [len(ids) for ids in prompt_ids], self.max_model_len, max_tokens
        )
        outputs = self.llm.generate(
            [{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False
        )
        groups = []
        for prompt, ids, out in zip(prompts, prompt_ids, outputs, strict=True):
            responses = [
                Response(
                    token_ids=list(c.token_ids),
                    text=c.text,
                    logprobs=_sampled_logprobs(c),
                    finish_reason=c.finish_reason,
                )
                for c in out.outputs
            ]
            groups.append(SampledGroup(prompt, ids, responses, self.policy_version))
        return groups

    def load_weights(self, named_tensors, version: int) -> LoadedWeights:
        """Load (name, tensor) pairs in place: a list, or an iterator that yields them as they
        arrive (the engine lives in this process, so the worker consumes it lazily). Returns
        the checksum of every tensor loaded (groupflow/weight_format.py)."""
        loaded = LoadedWeights(version)
        pairs = checksummed(named_tensors, loaded.checksums)
        if self.tensor_parallel_size > 1:
            # The workers are other processes: the sync reaches them as one message, full
            # tensors that each worker's weight loaders cut to its own shard, so the engine
            # holds the model once more while it loads (an iterator does not cross).
            pairs = list(pairs)
        self.llm.collective_rpc("load_named_tensors", args=(pairs,))
        # Cached prefixes were computed by the old weights.
        self.llm.reset_prefix_cache()
        self.policy_version = version
        return loaded

    def receive_weights(
        self, group: Broadcaster, buckets: list[Manifest], version: int, device: str
    ) -> LoadedWeights:
        """Receive the buckets from the weight group's rank 0 and load them in one pass: vLLM
        loads each layer once its tensors have arrived, while the next bucket is in transfer."""
        return self.load_weights(broadcast(group, buckets, device), version)

    def parameters_snapshot(self) -> dict:
        return self.llm.collective_rpc("named_parameters_snapshot")[0]


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
