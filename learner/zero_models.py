"""Building a rank's DeepSpeed ZeRO-3 models: the process group, the policy (model loaded
straight into shards, AdamW) and, when KL is on, the frozen reference.

`ZeroPolicy` is the policy's DeepSpeed model as learner/step.py's `Policy`. ("Engine" in this
project means a vLLM engine only; DeepSpeed's own class is `DeepSpeedEngine`.)
"""

from __future__ import annotations

import math
import os
import sys
import types
from dataclasses import dataclass

import torch
from torch import Tensor

from groupflow.config.job import Config
from groupflow.core.device import Device
from groupflow.learner.host_memory import release_freed_memory
from groupflow.learner.lora import AdaptersOff, add_adapters
from groupflow.learner.model_setup import prepare_model
from groupflow.learner.zero_config import deepspeed_config, model_parameter_count


@dataclass
class RankSetup:
    """Where a rank sits: what the actor layer knows and the job config does not."""

    model_path: str  # a local Hugging Face directory (the built-in model once it is built)
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    device: Device


@dataclass
class ZeroPolicy:
    """A DeepSpeed ZeRO-3 model as the step's Policy."""

    zero_model: object  # deepspeed.DeepSpeedEngine: the model wrapped, sharded, with AdamW
    world_size: int
    device: torch.device

    @property
    def model(self):
        return self.zero_model

    def backward(self, loss: Tensor, last_micro_batch: bool) -> None:
        self.zero_model.set_gradient_accumulation_boundary(last_micro_batch)
        # DeepSpeed averages gradients over ranks; the credit plan's coefficients already hold
        # the global denominator, so undo the average to get the plain sum over ranks.
        self.zero_model.backward(loss * self.world_size, scale_wrt_gas=False)
        # The micro-batch's activations are freed now; without this glibc keeps their pages
        # (learner/host_memory.py) and a CPU rank's resident memory grows to several times
        # what it allocates.
        release_freed_memory()

    def step(self) -> float:
        self.zero_model.step()
        norm = self.zero_model.get_global_grad_norm()
        return float(norm) if norm is not None else math.nan


@dataclass
class ZeroModels:
    policy: ZeroPolicy
    reference: object | None  # the frozen reference model (KL on), else None; callable
    # transformers finds the ZeRO-3 settings through a weak reference to this: kept alive
    # with the models, as from_pretrained and save_pretrained consult it.
    hf_ds_config: object


def build_zero_models(setup: RankSetup, cfg: Config) -> ZeroModels:
    """Join the ranks' process group and build this rank's models. Collective."""
    setup.device.prepare_process()
    os.environ.update(
        RANK=str(setup.rank),
        LOCAL_RANK="0",
        WORLD_SIZE=str(setup.world_size),
        MASTER_ADDR=setup.master_addr,
        MASTER_PORT=str(setup.master_port),
    )
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    skip_muon_import()
    deepspeed.init_distributed(dist_backend=setup.device.backend, verbose=False)
    torch.manual_seed(cfg.trainer.seed)
    ds_config = deepspeed_config(
        cfg.learner, cfg.model.dtype, model_parameter_count(setup.model_path), setup.world_size
    )
    # Alive during from_pretrained, this makes transformers load straight into ZeRO-3 shards.
    hf_ds_config = HfDeepSpeedConfig(ds_config)
    model = _load_model(setup.model_path, cfg, trainable=True)
    if cfg.learner.lora is not None:
        model = add_adapters(model, cfg.learner.lora)
    opt = cfg.learner.optimizer
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=opt.lr,
        betas=opt.betas,
        weight_decay=opt.weight_decay,
    )
    zero_model, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    # The frozen reference policy costs a second sharded copy: only when KL is on, and never
    # with LoRA, whose base model is the policy with its adapters off.
    reference = None
    if cfg.algorithm.kl.coef > 0 and cfg.learner.lora is not None:
        reference = AdaptersOff(zero_model)
    elif cfg.algorithm.kl.coef > 0:
        reference_model = _load_model(setup.model_path, cfg, trainable=False)
        reference, *_ = deepspeed.initialize(model=reference_model, config=ds_config)
        reference.eval()
    policy = ZeroPolicy(zero_model, setup.world_size, setup.device.torch_device())
    return ZeroModels(policy, reference, hf_ds_config)


MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def skip_muon_import() -> None:
    """DeepSpeed's ZeRO-3 optimizer imports its Muon optimizer at every build only to ask
    whether the optimizer is one, and that import compiles kernels through torch._inductor:
    2-5 s of CPU at each rank's start. A rank's optimizer is AdamW (build_zero_models), so
    the module is stood in for by one whose class no optimizer is an instance of."""
    if MUON_MODULE not in sys.modules:
        stand_in = types.ModuleType(MUON_MODULE)
        stand_in.MuonWithAuxAdam = type("MuonWithAuxAdam", (), {})
        sys.modules[MUON_MODULE] = stand_in


def _load_model(path: str, cfg: Config, trainable: bool):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, cfg.model.dtype))
    prepare_model(model, cfg.learner, trainable)
    return model
