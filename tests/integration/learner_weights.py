"""The learner's current parameters as the tests compare them: what its Hugging Face export
writes (learner/weight_export.py), read back."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file


def learner_weights(learner) -> dict[str, torch.Tensor]:
    """Every parameter of the learner's policy by its Hugging Face name (a tied output head
    is not among them)."""
    with tempfile.TemporaryDirectory() as tmp:
        learner.save_pretrained(tmp)
        files = sorted(Path(tmp).glob("*.safetensors"))
        assert files, f"the export wrote no weights: {sorted(p.name for p in Path(tmp).iterdir())}"
        return {name: t for f in files for name, t in load_file(f).items()}
