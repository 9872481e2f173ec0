"""Runs the fused token head (learner/fused_token_head.py) under Triton's interpreter, in a
process of its own, for tests/unit/test_fused_token_head.py.

Triton reads TRITON_INTERPRET when a kernel is defined and again while it runs (3.9 imports
its gluon package lazily and asserts interpreter mode there), so the variable must hold for
the life of the process: set in the test process, it would leak into every later test.

python -m tests.unit.fused_head_worker CASES OUT: CASES (torch.save'd) holds "heads", a list
of dicts of head inputs, and "models", a list of (seed, tied) of tiny Qwen2 models; OUT gets,
per head case, the statistics and the gradients of hidden and weight, and per model case the
statistics and every parameter's gradient, each through the fused head, and the number
of calls of the fused head.
"""

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import torch  # noqa: E402

from groupflow.learner import token_head  # noqa: E402
from groupflow.learner.fused_token_head import FusedHeadStats, TileSizes  # noqa: E402
from tests.unit.test_fused_token_head import model_case_loss, model_case_stats  # noqa: E402


def head_case(case: dict) -> dict:
    hidden = case["hidden"].clone().requires_grad_()
    weight = case["weight"].clone().requires_grad_()
    stats = FusedHeadStats.apply(
        hidden,
        weight,
        case["targets"],
        case["temperature"],
        case["chunk"],
        case["entropy_grad"],
        TileSizes(*case["tiles"]),
    )
    loss = (case["w_logp"] * stats[0]).sum()
    if case["entropy_grad"]:
        loss = loss + (case["w_entropy"] * stats[1]).sum()
    loss.backward()
    return {"stats": [s.detach() for s in stats], "hidden": hidden.grad, "weight": weight.grad}


def model_case(seed: int, tied: bool) -> dict:
    model, stats = model_case_stats(seed, tied)
    model_case_loss(seed, stats).backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    stats = (stats.logp, stats.entropy, stats.sum_p2)
    return {"stats": [s.detach() for s in stats], "grads": grads}


def main(cases_path: str, out_path: str) -> None:
    cases = torch.load(cases_path)
    # The models' heads are selected as on CUDA although their tensors are on the CPU, and
    # the fused head counts its calls, which shows that it ran.
    calls = []
    select, apply = token_head.head_stats_function, FusedHeadStats.apply
    token_head.head_stats_function = lambda device: select(torch.device("cuda"))
    FusedHeadStats.apply = lambda *args: calls.append(args) or apply(*args)
    torch.save(
        {
            "heads": [head_case(c) for c in cases["heads"]],
            "models": [model_case(*c) for c in cases["models"]],
            "fused_calls": len(calls),
        },
        out_path,
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
