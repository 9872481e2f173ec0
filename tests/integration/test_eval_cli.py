"""`groupflow eval`: held-out greedy accuracy of a model directory, one engine in-process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from groupflow.loop.saved_model import complete_saved_model
from tests.hf_cache import cache_model, offline_env

pytestmark = pytest.mark.integration


def _eval(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "groupflow.run.cli", "eval", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=None if env is None else {**os.environ, **env},
    )


def _evals_side_by_side(
    runs: list[list[str]], env: dict[str, str]
) -> list[subprocess.CompletedProcess]:
    """`groupflow eval` of each argument list, all at once: an eval is mostly one process
    importing vLLM and starting its engine on one core, so on 2 cores two of them take about
    the time of one (three engines' memory is less than test_stack.py's module holds)."""
    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        return list(pool.map(lambda args: _eval(*args, env=env), runs))


def test_eval_of_a_missing_model_is_one_line(tmp_path):
    proc = _eval("--model", str(tmp_path / "absent"))
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "model.path" in line and "absent" in line


def _adapter(model_dir: str, out, base: str, seed: int):
    """A rank-8 adapter on q_proj and down_proj of the model in `model_dir`, B random, saved in
    PEFT's format naming `base` as its base model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "down_proj"])
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    peft_model.peft_config["default"].base_model_name_or_path = base
    peft_model.save_pretrained(out)
    return peft_model


# The quickstart model's raw prompt ("1-4+5=") rendered from the arithmetic task's chat wording,
# the system turn left out: a chat template the quickstart model answers under.
RAW_TEXT_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'user' %}{{ m.content | replace('Compute ', '') "
    "| replace('. Reply with the resulting integer only.', '=') }}{% endif %}{% endfor %}"
)


def test_eval_of_a_model_and_of_an_adapter_is_that_of_its_merged_model(quickstart_model, tmp_path):
    """Under a chat template (chat_template.jinja) with a system turn, which needs a template:
    the adapter served on its base scores as the model it merges into, saved as groupflow saves
    a policy (groupflow/loop/saved_model.py), whose own template it renders. The base is named by a
    hub id, from a Hugging Face cache read offline: the adapter's base_model_name_or_path, and
    the plain model evaluated last."""
    from transformers import AutoTokenizer

    base = tmp_path / "base"
    shutil.copytree(quickstart_model, base)
    tokenizer = AutoTokenizer.from_pretrained(quickstart_model)
    tokenizer.chat_template = RAW_TEXT_TEMPLATE
    tokenizer.save_pretrained(base)
    hf_home = tmp_path / "hf"
    snapshot = cache_model(hf_home, "groupflow/quickstart", base)
    peft_model = _adapter(str(base), tmp_path / "adapter", "groupflow/quickstart", seed=0)
    merged = tmp_path / "merged"
    peft_model.merge_and_unload().save_pretrained(merged)
    complete_saved_model(str(base), merged, "auto")
    settings = [
        "--set",
        "task.eval_size=64",
        "--set",  # a system turn: refused where the model directory has no template
        "task.system_prompt=answer with a number",
    ]
    models = (tmp_path / "adapter", merged, "groupflow/quickstart")
    runs = [["--model", str(model), *settings] for model in models]
    results = []
    for proc in _evals_side_by_side(runs, offline_env(hf_home)):
        assert proc.returncode == 0, proc.stderr[-2000:]
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    adapter, merged_score, base_score = (r["accuracy"] for r in results)
    assert adapter == merged_score
    assert adapter != base_score, "the adapter must change the answers for this test to see it"
    # the plain model, by its hub id: one JSON line of its own, served from the snapshot
    assert results[2]["prompts"] == 64 and results[2]["task"] == "arithmetic"
    assert results[2]["model"] == str(snapshot)
    # the warm-started model answers some, not all, held-out problems
    assert 0.0 < base_score < 1.0


def test_an_adapter_of_another_model_is_one_line(quickstart_model, tmp_path):
    from transformers import AutoConfig

    from groupflow.core.random_model import random_causal_lm

    other = tmp_path / "other"
    random_causal_lm(
        AutoConfig.from_pretrained(quickstart_model).vocab_size,
        seed=0,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    ).save_pretrained(other)
    _adapter(str(other), tmp_path / "adapter", quickstart_model, seed=1)
    proc = _eval("--model", str(tmp_path / "adapter"))
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "adapter_model.safetensors" in line and "an adapter of another model" in line
