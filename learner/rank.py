"""One learner rank: a DeepSpeed ZeRO-3 engine over a Hugging Face causal LM.

No Ray in here; actors/learner.py wraps it. Every public method is collective: all ranks
call it together with their own share of the step (see learner/batching.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from groupflow.collective import WeightGroup
from groupflow.config import AlgorithmConfig, LearnerConfig
from groupflow.records import TrainSequence
from groupflow.learner.credit import CreditPlan, MiniBatchTokens, plan_credit
from groupflow.learner.device import Device
from groupflow.learner.losses import token_loss
from groupflow.learner.token_stats import TokenStats, token_stats


@dataclass
class RankSetup:
    model_path: str
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    device: Device
    dtype: str = "float32"
    temperature: float = 1.0
    seed: int = 0


@dataclass
class StepResult:
    """One rank's share of a step's figures; the driver combines the ranks."""

    sums: dict[str, float] = field(default_factory=dict)  # summed over this rank's tokens
    counts: dict[str, float] = field(default_factory=dict)
    plan_stats: list[dict[str, float]] = field(default_factory=list)  # global, per mini-batch
    grad_norms: list[float] = field(default_factory=list)
    optimizer_updates: int = 0
    # (group_id, response token ids, dLoss/dlogp per token) for the cancellation diagnostic
    token_grads: list[tuple[int, list[int], list[float]]] = field(default_factory=list)


@dataclass
class BehaviourTokens:
    """Per-sequence quantities fixed before the update: old policy (and reference) log-probs."""

    stats: TokenStats
    ref_logp: torch.Tensor | None


class DistributedReducer:
    """torch.distributed reductions for the credit planner."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def _all_reduce(self, t: torch.Tensor, op) -> torch.Tensor:
        import torch.distributed as dist

        out = t.detach().clone()
        dist.all_reduce(out, op=op)
        return out

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        return self._all_reduce(t, dist.ReduceOp.SUM)

    def max(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        return self._all_reduce(t, dist.ReduceOp.MAX)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        parts: list = [None] * self.world_size
        dist.all_gather_object(parts, t.detach().cpu())
        return torch.cat(parts).to(t.device)


def deepspeed_config(cfg: LearnerConfig, dtype: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.optimizer.max_grad_norm,
        "zero_optimization": {"stage": cfg.zero_stage},
        "bf16": {"enabled": dtype == "bfloat16"},
        "fp16": {"enabled": dtype == "float16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
    }


class LearnerRank:
    def __init__(self, setup: RankSetup, cfg: LearnerConfig, algo: AlgorithmConfig):
        self.setup, self.cfg, self.algo = setup, cfg, algo
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

        deepspeed.init_distributed(dist_backend=setup.device.backend, verbose=False)
        torch.manual_seed(setup.seed)
        ds_config = deepspeed_config(cfg, setup.dtype)
        # Alive during from_pretrained, this makes transformers load straight into ZeRO-3 shards.
        self._hf_ds_config = HfDeepSpeedConfig(ds_config)
        model = self._load_model()
        opt = cfg.optimizer
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay
        )
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        # The frozen reference policy costs a second sharded copy: only when KL is on.
        self.reference = None
        if algo.kl.coef > 0:
            self.reference, *_ = deepspeed.initialize(model=self._load_model(), config=ds_config)
            self.reference.eval()
        self.reducer = DistributedReducer(setup.world_size)
        self.device = setup.device.torch_device()

    def _load_model(self):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            self.setup.model_path, dtype=getattr(torch, self.setup.dtype)
        )
        model.config.use_cache = False
        return model

    # ----- forward -------------------------------------------------------------------------
    def _forward(
        self, engine, seqs: list[TrainSequence], grad: bool
    ) -> tuple[list[TokenStats], torch.Tensor | None]:
        """Per-sequence TokenStats of the response tokens. An empty micro-batch still runs a
        forward on one token (and returns its zero loss) because ZeRO-3 ranks must all take
        part in every parameter gather."""
        rows = [s.input_ids for s in seqs] or [[0]]
        width = max(map(len, rows))
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        attention = torch.zeros(len(rows), width, dtype=torch.long)
        for r, row in enumerate(rows):
            ids[r, : len(row)] = torch.tensor(row)
            attention[r, : len(row)] = 1
        ids, attention = ids.to(self.device), attention.to(self.device)
        with torch.set_grad_enabled(grad):
            logits = engine(input_ids=ids, attention_mask=attention).logits
            if not seqs:
                return [], logits.sum() * 0.0
            # position t predicts token t+1: select each response's predicting positions
            rows_idx, pos_idx = [], []
            for r, s in enumerate(seqs):
                positions = torch.arange(s.prompt_len - 1, len(s.input_ids) - 1)
                rows_idx.append(torch.full_like(positions, r))
                pos_idx.append(positions)
            rows_t, pos_t = torch.cat(rows_idx).to(self.device), torch.cat(pos_idx).to(self.device)
            stats = token_stats(
                logits[rows_t, pos_t],
                ids[rows_t, pos_t + 1],
                self.setup.temperature,
                entropy_grad=grad and self.algo.entropy_coef != 0,
            )
        sizes = [s.num_response_tokens for s in seqs]
        parts = zip(
            stats.logp.split(sizes),
            stats.entropy.split(sizes),
            stats.sum_p2.split(sizes),
            strict=True,
        )
        return [TokenStats(*p) for p in parts], None

    def _no_grad_stats(self, engine, micro_batches: list[list[TrainSequence]]) -> list[TokenStats]:
        out: list[TokenStats] = []
        for mb in micro_batches:
            out.extend(self._forward(engine, mb, grad=False)[0])
        return out

    def _behaviour(self, micro_batches: list[list[TrainSequence]]) -> list[BehaviourTokens]:
        old = self._no_grad_stats(self.engine, micro_batches)
        if self.reference is None:
            return [BehaviourTokens(s, None) for s in old]
        ref = self._no_grad_stats(self.reference, micro_batches)
        return [BehaviourTokens(s, r.logp) for s, r in zip(old, ref, strict=True)]

    # ----- one step ------------------------------------------------------------------------
    def train_step(self, minibatches: list[list[list[TrainSequence]]]) -> StepResult:
        """minibatches[m][k] = this rank's k-th micro-batch of mini-batch m."""
        self.engine.train()
        result = StepResult()
        # old_logp (and ref_logp) are fixed for the whole step, Lopti's two stages included.
        behaviour = [self._behaviour(mini) for mini in minibatches]
        for m, mini in enumerate(minibatches):
            seqs = [s for mb in mini for s in mb]
            old = [b.stats for b in behaviour[m]]
            # The first mini-batch sees the parameters that produced old_logp; later ones don't.
            cur = old if m == 0 else self._no_grad_stats(self.engine, mini)
            plan = plan_credit(_pad_tokens(seqs, old, cur, self.device), self.algo, self.reducer)
            result.plan_stats.append(plan.stats)
            self._record_behaviour(result, seqs, old)
            grads = [torch.zeros(s.num_response_tokens, dtype=torch.float64) for s in seqs]
            for stage in plan.stages:
                self._update(mini, behaviour[m], plan, stage, result, grads)
            if self.algo.cancellation_diagnostic:
                result.token_grads.extend(
                    (s.group_id, s.input_ids[s.prompt_len :], g.tolist())
                    for s, g in zip(seqs, grads, strict=True)
                )
        return result

    def _update(self, mini, behaviour, plan: CreditPlan, stage, result: StepResult, grads) -> None:
        """One optimizer update over the mini-batch's micro-batches with stage coefficients."""
        offset = 0
        for k, mb in enumerate(mini):
            per_seq, empty_loss = self._forward(self.engine, mb, grad=True)
            logp = None
            if empty_loss is not None:
                loss = empty_loss
            else:
                rows = slice(offset, offset + len(mb))
                loss, logp = self._micro_loss(per_seq, behaviour[rows], plan, stage, rows, result)
            # DeepSpeed averages gradients over ranks; the coefficients already hold the global
            # denominator, so undo the average to get the plain sum over ranks.
            self.engine.set_gradient_accumulation_boundary(k == len(mini) - 1)
            self.engine.backward(loss * self.setup.world_size, scale_wrt_gas=False)
            if logp is not None and logp.grad is not None:
                g = logp.grad.detach().double().cpu() / self.setup.world_size
                for j in range(len(mb)):
                    grads[offset + j] += g[j, : len(grads[offset + j])]
                offset += len(mb)
        self.engine.step()
        result.optimizer_updates += 1
        norm = self.engine.get_global_grad_norm()
        result.grad_norms.append(float(norm) if norm is not None else float("nan"))

    def _micro_loss(self, per_seq: list[TokenStats], behaviour, plan, stage, rows, result):
        logp = _pad([s.logp for s in per_seq], self.device)
        if self.algo.cancellation_diagnostic:
            logp.retain_grad()  # dLoss/dlogp per token feeds cancellation_residual
        old_logp = _pad([b.stats.logp for b in behaviour], self.device)
        ref_logp = None
        if self.reference is not None:
            ref_logp = _pad([b.ref_logp for b in behaviour], self.device)
        entropy = _pad([s.entropy for s in per_seq], self.device)
        mask = _pad([torch.ones_like(s.logp) for s in per_seq], self.device)
        width = logp.shape[1]
        out = token_loss(
            logp,
            old_logp,
            plan.token_adv[rows, :width],
            mask,
            self.algo,
            ref_logp=ref_logp,
            entropy=entropy if self.algo.entropy_coef != 0 else None,
        )
        loss = (stage[rows, :width] * out.loss).sum()
        valid = mask.bool()
        _add(result.sums, "clip_low", out.clipped_low[valid].sum().item())
        _add(result.sums, "clip_high", out.clipped_high[valid].sum().item())
        _add(result.sums, "kl_ref", out.kl[valid].sum().item())
        _add(result.counts, "update_tokens", valid.sum().item())
        # k2 estimate of KL(old || current) on the tokens as they are about to be updated
        approx_kl = 0.5 * (logp.detach() - old_logp) ** 2
        _add(result.sums, "approx_kl", approx_kl[valid].sum().item())
        return loss, logp

    def _record_behaviour(self, result: StepResult, seqs, old: list[TokenStats]) -> None:
        for s, stats in zip(seqs, old, strict=True):
            sign = "pos" if s.advantage > 0 else "neg" if s.advantage < 0 else "zero"
            for key in ("", f"_{sign}"):
                _add(result.sums, f"entropy{key}", stats.entropy.sum().item())
                _add(result.counts, f"tokens{key}", len(stats.entropy))
            if s.vllm_logprobs:
                vllm = torch.tensor(s.vllm_logprobs, dtype=stats.logp.dtype)
                diff = (stats.logp.cpu() - vllm).abs()
                _add(result.sums, "logp_mismatch", diff.sum().item())
                worst = max(result.sums.get("logp_mismatch_max", 0.0), diff.max().item())
                result.sums["logp_mismatch_max"] = worst

    # ----- weights ---------------------------------------------------------------------------
    def gathered_weights(self) -> list[tuple[str, torch.Tensor]] | None:
        """Full parameters in Hugging Face names on rank 0 (None elsewhere). Collective."""
        import deepspeed

        out = []
        for name, param in self.engine.module.named_parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                if self.setup.rank == 0:
                    out.append((name, param.detach().to("cpu", copy=True)))
        return out if self.setup.rank == 0 else None

    def weight_manifest(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(name, full shape, dtype) of every parameter, in broadcast order."""
        return [
            (name, tuple(getattr(p, "ds_shape", p.shape)), str(p.dtype).removeprefix("torch."))
            for name, p in self.engine.module.named_parameters()
        ]

    def broadcast_weights(self, group: WeightGroup | None) -> None:
        """Gather each parameter from the ZeRO-3 shards (collective over ranks) and, on rank 0,
        broadcast it to the engines in `group` one tensor at a time (never a full copy)."""
        import deepspeed

        for _, param in self.engine.module.named_parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                if group is not None:
                    group.broadcast(param.data.contiguous())

    def save_pretrained(self, path: str) -> None:
        """The current policy in Hugging Face format (written by rank 0). Collective."""
        weights = self.gathered_weights()
        if weights is not None:
            self.engine.module.save_pretrained(path, state_dict=dict(weights))


def _add(d: dict, key: str, value: float) -> None:
    d[key] = d.get(key, 0.0) + value


def _pad(rows: list[torch.Tensor], device) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True).to(device)


def _pad_tokens(seqs: list[TrainSequence], old, cur, device) -> MiniBatchTokens:
    return MiniBatchTokens(
        mask=_pad([torch.ones_like(s.logp) for s in old], device),
        old_logp=_pad([s.logp for s in old], device),
        cur_logp=_pad([s.logp for s in cur], device),
        old_entropy=_pad([s.entropy for s in old], device),
        cur_entropy=_pad([s.entropy for s in cur], device),
        cur_sum_p2=_pad([s.sum_p2 for s in cur], device),
        advantages=torch.tensor([s.advantage for s in seqs], dtype=torch.float32, device=device),
        group_ids=torch.tensor([s.group_id for s in seqs], dtype=torch.long, device=device),
    )
