"""The built-in quickstart model: a small Qwen2-architecture model with a character tokenizer,
built locally (no model hub) and given a short supervised warm start on the arithmetic task.
groupflow/run/small_moe.py builds its mixture-of-experts sibling the same way.

The result is cached by a hash of everything that shapes it, so only the first run pays.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import string
import sys
from pathlib import Path

import torch

from groupflow.core.errors import UserError
from groupflow.core.random_model import random_causal_lm
from groupflow.observe.driver_log import FILE_ONLY
from groupflow.observe.progress import PhaseProgress

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]
CHARACTERS = list(string.digits + "+-*/=()., " + string.ascii_letters)
ARCHITECTURE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=True,
    rope_theta=10000.0,
)
WARM_START = dict(batch_size=64, lr=1e-3, warmup=30, seed=0)


_CACHE_SETTING = "the model cache (GROUPFLOW_CACHE, else ~/.cache/groupflow)"


def cache_root() -> Path:
    return Path(os.environ.get("GROUPFLOW_CACHE", Path.home() / ".cache" / "groupflow"))


def _why(err: OSError) -> str:
    return err.strerror or type(err).__name__


def _check_cache_writable(directory: Path) -> None:
    """Before the warm start (minutes): a cache that is a file, or not writable, in one line."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UserError(f"{_CACHE_SETTING} ({directory}): not a directory") from None
    except OSError as err:
        raise UserError(f"{_CACHE_SETTING} ({directory}): {_why(err)}") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise UserError(f"{_CACHE_SETTING} ({directory}): not writable")


def build_tokenizer(extra_characters: str = "", chat_template: str | None = None):
    """A character-level fast tokenizer that vLLM and transformers load like any other; a task
    may add characters of its own and a chat template (tool_arithmetic's tool calls)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    characters = CHARACTERS + [c for c in extra_characters if c not in CHARACTERS]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + characters)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def build_model(tokenizer, seed: int, architecture: str = "qwen2", shape: dict = ARCHITECTURE):
    return random_causal_lm(
        len(tokenizer),
        architecture=architecture,
        seed=seed,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        **shape,
    )


def _sft_batch(task, prompts, tokenizer, batch_size: int):
    """Prompt + demonstration + eos, loss on the demonstration tokens only. A task that
    teaches a worked answer (long_addition's scratchpad) says so with `demonstration`;
    otherwise the demonstration is the bare answer."""
    from groupflow.reward_workers.tasks.base import demonstration_turns

    ids, labels = [], []
    for p in (next(prompts) for _ in range(batch_size)):
        prompt_ids = tokenizer.encode(p.text)
        ids.append(prompt_ids)
        labels.append([-100] * len(prompt_ids))
        for text, trained in demonstration_turns(task, p):
            piece = tokenizer.encode(text) if text else [tokenizer.eos_token_id]
            ids[-1] += piece
            labels[-1] += piece if trained else [-100] * len(piece)
    width = max(map(len, ids))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([x + [pad] * (width - len(x)) for x in ids])
    label_ids = torch.tensor([y + [-100] * (width - len(y)) for y in labels])
    return input_ids, label_ids, input_ids != pad


def warm_start(model, tokenizer, task, steps: int, progress: bool = True) -> None:
    """Short supervised training on task answers so that RL starts from a model that can answer."""
    from tqdm import tqdm

    cfg = WARM_START
    prompts = task.train_prompts(seed=cfg["seed"] + 10_000)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / cfg["warmup"])
    )
    model.train()
    # On a terminal a bar, and its lines in driver.log alone; elsewhere (logs, CI, Ray jobs)
    # the lines.
    bar_on = progress and sys.stderr.isatty()
    bar = tqdm(range(steps), desc="warm start", disable=not bar_on, mininterval=2.0)
    lines = PhaseProgress("warm start", steps, "steps", say=FILE_ONLY.info if bar_on else log.info)
    for step in bar:
        input_ids, labels, attention = _sft_batch(task, prompts, tokenizer, cfg["batch_size"])
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        shown = f"{loss.item():.3f}"
        bar.set_postfix(loss=shown, refresh=False)
        lines.update(step + 1, f"loss {shown}")
    lines.close()
    model.eval()


def _publish(partial: Path, target: Path) -> None:
    """Rename a finished build onto its target. Two processes may build the same model at once
    (two first runs side by side): the one that renames second finds the target already there,
    as finished as its own (only a rename makes a target), so it uses that one and drops its own."""
    try:
        partial.rename(target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
        shutil.rmtree(partial, ignore_errors=True)


def quickstart_model_path(
    task_name: str,
    task_options: dict,
    warm_start_steps: int,
    progress: bool = True,
    architecture: str = "qwen2",
    shape: dict = ARCHITECTURE,
) -> Path:
    """Return the cached quickstart model directory, building it on first use: by default
    the quickstart's Qwen2, or a model of another `architecture` (random_model.py) and
    `shape` (its config keys), built, warm-started and cached the same way."""
    from groupflow.reward_workers.tasks import make_task
    from groupflow.reward_workers.tasks.base import demonstration_turns

    task = make_task(task_name, task_options)
    # before the build (minutes): a task the warm start cannot demonstrate, in one line
    demonstration_turns(task, next(task.train_prompts(seed=WARM_START["seed"] + 10_000)))
    spec = dict(
        version=1,
        architecture=shape,
        characters="".join(CHARACTERS),
        warm_start=WARM_START,
        steps=warm_start_steps,
        task=task_name,
        options=task_options,
    )
    # A task that teaches worked answers names their format, so that a change of the format
    # is a new model (tasks that teach the bare answer keep their models' old keys).
    if hasattr(task, "DEMONSTRATION_FORMAT"):
        spec["demonstration"] = task.DEMONSTRATION_FORMAT
    if hasattr(task, "EXTRA_CHARACTERS"):
        spec["characters"] += task.EXTRA_CHARACTERS
        spec["chat_template"] = task.CHAT_TEMPLATE
    name = "quickstart"
    if architecture != "qwen2":  # the quickstart's own keys (and cached models) stay as they were
        spec["model_type"] = architecture
        name += f"-{architecture}"
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    target = cache_root() / f"{name}-{digest}"
    if (target / "config.json").is_file():
        return target
    _check_cache_writable(target.parent)
    log.info(
        "building the quickstart model (first run only, %d warm-start steps) into %s",
        warm_start_steps,
        target,
    )
    random.seed(WARM_START["seed"])
    tokenizer = build_tokenizer(
        getattr(task, "EXTRA_CHARACTERS", ""), getattr(task, "CHAT_TEMPLATE", None)
    )
    model = build_model(tokenizer, WARM_START["seed"], architecture, shape)
    warm_start(model, tokenizer, task, warm_start_steps, progress)
    # Write to a temporary directory and rename, so a cut-off build never looks finished.
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        (partial / "groupflow_spec.json").write_text(json.dumps(spec, indent=1))
        _publish(partial, target)
    except OSError as err:  # the disk filled up, or the cache changed under the build
        raise UserError(f"{_CACHE_SETTING} ({target.parent}): {_why(err)}") from None
    log.info("quickstart model ready")
    return target
