"""Four ranks of torch.distributed on gloo, one process each, for
tests/unit/test_sequence_parallel.py: every case's learner step (learner/step.py on the tiny
float64 model of tests/unit/test_learner_step.py) at sequence-parallel size 1 (on one rank
alone, which hands its results to the others), 2 (two groups of two, data parallel over them)
and 4 (one group), and how far each rank's losses and gradients of every update of sizes 2
and 4 are from size 1's.

The ranks' policies leave the weights where they are (a learning rate of 0): every update's
gradient is then taken at the same weights at every size, so rounding is all that separates
them (an update would magnify it in the next one's gradient; tests/unit/test_learner_step.py
covers the updates themselves).
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist

from groupflow.config.learner import LoraConfig
from groupflow.learner.credit import LocalReducer
from groupflow.learner.distributed import DistributedReducer
from groupflow.learner.lora import add_adapters
from groupflow.learner.sequence_parallel import install_ulysses, parallel_groups
from groupflow.learner.step import StepSettings, train_step
from tests.unit.test_learner_step import TEMPERATURE, algorithm, layout, sample_step, tiny_model

WORLD = 4
# What the ranks import, transformers' model classes and peft (lazily, with their first model)
# included: imported once, in the process the ranks are forked from, rather than by each rank
PRELOAD = [
    __name__,
    "peft",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
]


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    preset: str
    keys: dict
    packed: bool
    many_micro_batches: bool
    lora: bool = False
    checkpointing: bool = False


class RecordingRank:
    """learner/step.py's Policy: sums the ranks' gradients at each update (as ZeRO-3 does)
    and records them, and the losses backpropagated; the weights stay put."""

    def __init__(self, model, distributed: bool, count_loss: bool):
        self.model, self.distributed, self.count_loss = model, distributed, count_loss
        self.device = torch.device("cpu")
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.grads: list[list[torch.Tensor]] = []
        self.loss = torch.zeros((), dtype=torch.float64)

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        if self.count_loss:
            self.loss += loss.detach()
        loss.backward()

    def step(self) -> float:
        grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in self.params]
        if self.distributed:
            # One collective for all of them: each is a round across the four processes,
            # which share two cores in the suite (one per parameter made most of the time)
            flat = torch.cat([g.flatten() for g in grads])
            dist.all_reduce(flat)
            grads = [
                part.view_as(g)
                for part, g in zip(flat.split([g.numel() for g in grads]), grads, strict=True)
            ]
        self.grads.append(grads)
        for p in self.params:
            p.grad = None
        return 0.0


def with_observations(seqs, gen: torch.Generator):
    """Every third sequence with a run of observation tokens inside its response (a tool's
    result), its vLLM log-probs cut to its model tokens."""
    out = []
    for i, s in enumerate(seqs):
        n = s.num_response_tokens
        if i % 3 or n < 3:
            out.append(s)
            continue
        start = int(torch.randint(1, n - 1, (), generator=gen))
        mask = [0 if start <= t < start + 2 else 1 for t in range(n)]
        vllm = s.vllm_logprobs[: sum(mask)] if s.vllm_logprobs else []
        out.append(dataclasses.replace(s, loss_mask=mask, vllm_logprobs=vllm))
    return out


def case_model(case: Case, gen: torch.Generator):
    model = tiny_model(gen)
    if case.lora:
        model = add_adapters(model, LoraConfig(rank=4, alpha=8.0))
        with torch.no_grad():  # B starts at 0, which would leave A without a gradient
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    if case.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def size_one(case: Case, owner: int, rank: int, model, reference, seqs, algo, gen):
    """Size 1's gradients of every update and its loss, on every rank. The ranks draw the same
    model and sequences, so one rank (the case's owner, in turn) takes the step and hands its
    results to the others: the same step on each of the four would be three for nothing."""
    cut = layout(seqs, gen, 1, case.many_micro_batches)  # on every rank: keeps `gen` in step
    params = [p for p in model.parameters() if p.requires_grad]
    count = torch.zeros((), dtype=torch.int64)
    if rank == owner:
        one = RecordingRank(copy.deepcopy(model), distributed=False, count_loss=True)
        settings = StepSettings(algo, TEMPERATURE, LocalReducer(), case.packed)
        train_step(one, reference, cut[0], settings)
        count += len(one.grads)
    dist.broadcast(count, owner)
    sizes = [p.numel() for p in params] * int(count)
    flat = torch.zeros(sum(sizes) + 1, dtype=torch.float64)
    if rank == owner:
        flat = torch.cat([g.flatten() for grads in one.grads for g in grads] + [one.loss[None]])
    dist.broadcast(flat, owner)
    parts, n = flat[:-1].split(sizes), len(params)
    grads = [
        [part.view_as(p) for part, p in zip(parts[u * n : (u + 1) * n], params, strict=True)]
        for u in range(int(count))
    ]
    return grads, flat[-1]


def run_case(case: Case, index: int, rank: int, groups: dict, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    algo = algorithm(case.preset, **case.keys)
    model = case_model(case, gen)
    seqs = with_observations(sample_step(model, gen, algo, num_groups=4), gen)
    reference = copy.deepcopy(model).eval() if algo.kl.coef > 0 else None
    out = {"widths_not_dividing": sorted({len(s.input_ids) % 4 for s in seqs})}
    owner = index % WORLD
    one_grads, one_loss = size_one(case, owner, rank, model, reference, seqs, algo, gen)

    for size, parallel in groups.items():
        sp = parallel.sequence
        policy = RecordingRank(copy.deepcopy(model), distributed=True, count_loss=sp.rank == 0)
        install_ulysses(policy.model, sp)
        ref = None
        if reference is not None:
            ref = copy.deepcopy(reference)
            install_ulysses(ref, sp)
        reducer = DistributedReducer(parallel.data_size, torch.device("cpu"), parallel.data_group)
        settings = StepSettings(algo, TEMPERATURE, reducer, case.packed, sequence_parallel=sp)
        cut = layout(seqs, gen, parallel.data_size, case.many_micro_batches)
        train_step(policy, ref, cut[rank // size], settings)
        dist.all_reduce(policy.loss)
        assert len(policy.grads) == len(one_grads), "as many updates at every size"
        worst = 0.0
        for got, want in zip(policy.grads, one_grads, strict=True):
            for g, w in zip(got, want, strict=True):
                scale = w.abs().max().item()
                if scale > 0:
                    worst = max(worst, (g - w).abs().max().item() / scale)
                else:
                    worst = max(worst, g.abs().max().item())
        out[size] = {
            "grad_error": worst,
            "loss": policy.loss.item(),
            "loss_one": one_loss.item(),
            "grad_scale": max(w.abs().max().item() for ws in one_grads for w in ws),
        }
    return out


def run_rank(rank: int, port: int, cases: list[Case], seed: int) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        groups = {size: parallel_groups(WORLD, rank, size) for size in (2, 4)}
        return {
            case.name: run_case(case, i, rank, groups, seed + i) for i, case in enumerate(cases)
        }
    finally:
        dist.destroy_process_group()
