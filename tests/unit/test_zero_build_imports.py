"""A rank's ZeRO-3 build does not import DeepSpeed's Muon optimizer (learner/zero_models.py
skip_muon_import): its module compiles kernels (original_muon's torch.compile) at every rank
start, 2-5 s of CPU, only for an isinstance check that AdamW never passes."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys, torch
{before}
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
adamw = torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
print(isinstance(adamw, MuonWithAuxAdam), "deepspeed.runtime.zero.muon.original_muon" in sys.modules)
"""


def _probe(before: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(before=before)],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.split()[-2:]


def test_the_muon_question_is_answered_without_compiling_its_kernels():
    stood_in = _probe(
        "from groupflow.learner.zero_models import skip_muon_import\nskip_muon_import()"
    )
    assert stood_in == ["False", "False"]
    assert _probe("") == ["False", "True"]  # DeepSpeed's own module: what is skipped
