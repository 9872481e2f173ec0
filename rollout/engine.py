"""A vLLM engine for grouped sampling: one request with n = G per prompt.

No Ray in here; actors/generator.py wraps it. The engine lives in the caller's process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so that weights can be swapped in place.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from groupflow.records import Prompt, Response, SampledGroup

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


def engine_settings(cfg, model_path: str, seed: int) -> EngineSettings:
    """The engine part of a job config (groupflow.config.Config)."""
    return EngineSettings(
        model_path=model_path,
        dtype=cfg.model.dtype,
        max_model_len=cfg.rollout.max_model_len,
        kv_cache_gib=cfg.rollout.kv_cache_gib,
        gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
        seed=seed,
    )


class RolloutEngine:
    def __init__(self, settings: EngineSettings):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(settings.kv_cache_gib))))
        from vllm import LLM

        self.llm = LLM(
            model=settings.model_path,
            dtype=settings.dtype,
            max_model_len=settings.max_model_len,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            seed=settings.seed,
            enforce_eager=True,
            # Log-probs after temperature: the same distribution the learner recomputes.
            logprobs_mode="processed_logprobs",
            worker_extension_cls="groupflow.rollout.weight_receiver.WeightReceiver",
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.policy_version = 0

    def sample_groups(
        self, prompts: list[Prompt], group_size: int, sampling: SamplingConfig
    ) -> list[SampledGroup]:
        """G sampled responses for each prompt, with their token ids and log-probs."""
        from vllm import SamplingParams

        params = SamplingParams(
            n=group_size,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_tokens,
            logprobs=0,
        )
        return self._generate(prompts, params)

    def greedy(self, prompts: list[Prompt], max_tokens: int) -> list[str]:
        """One greedy completion per prompt (held-out evaluation)."""
        from vllm import SamplingParams

        groups = self._generate(
            prompts, SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens)
        )
        return [g.responses[0].text for g in groups]

    def _generate(self, prompts: list[Prompt], params) -> list[SampledGroup]:
        prompt_ids = [self.tokenizer.encode(p.text) for p in prompts]
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
                )
                for c in out.outputs
            ]
            groups.append(SampledGroup(prompt, ids, responses, self.policy_version))
        return groups

    def load_weights(self, named_tensors, version: int) -> None:
        self.llm.collective_rpc("load_named_tensors", args=(named_tensors,))
        # Cached prefixes were computed by the old weights.
        self.llm.reset_prefix_cache()
        self.policy_version = version

    def receive_weights(self, group, manifest, version: int, device: str) -> None:
        """Receive every tensor of `manifest` from the weight group's rank 0, then load them."""
        import torch

        named = []
        for name, shape, dtype in manifest:
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            group.broadcast(tensor)
            named.append((name, tensor))
        self.load_weights(named, version)

    def parameters_snapshot(self) -> dict:
        return self.llm.collective_rpc("named_parameters_snapshot")[0]


def _sampled_logprobs(completion) -> list[float]:
    if completion.logprobs is None:
        return []
    return [
        step[tok].logprob
        for tok, step in zip(completion.token_ids, completion.logprobs, strict=True)
    ]
