"""What makes a saved policy a complete Hugging Face model directory, written beside the weights
wherever groupflow saves a model: the run's final `model/`, a checkpoint's `hf/`, and with LoRA
the `merged/` model inside either (the adapter directory gets the tokenizer too, as PEFT's do).

- The base model's tokenizer, saved by the tokenizer itself (`save_pretrained`), so that every
  format transformers reads is written whole (tokenizer.json, its config, chat_template.jinja,
  added tokens...), and the base's own vocabulary files of that format beside it
  (vocab.json/merges.txt, tokenizer.model), which tools other than transformers read.
- The chat template the policy was trained with (`task.chat_template`): the base's own, the
  job's template file, or none at all when the job rendered raw text, so that `groupflow eval`,
  `vllm serve` or transformers render prompts as training did.
- The base's generation_config.json (stop tokens, default sampling), which vLLM reads.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from groupflow.core.adapters import MERGED_DIR
from groupflow.rollout.prompt_render import job_chat_template

GENERATION_CONFIG = "generation_config.json"
ADDED_TOKENS = "added_tokens.json"  # an older layout's added tokens, kept beside the vocabulary


def complete_saved_model(base: str, saved: Path, chat_template: str) -> None:
    """Complete the policy saved in `saved` (and its merged model, with LoRA) from the `base`
    model directory it was trained from; `chat_template` is the job's `task.chat_template`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    if chat_template != "auto":  # "auto" keeps the base's own templates as they are
        tokenizer.chat_template = job_chat_template(tokenizer, chat_template)
    merged = saved / MERGED_DIR
    for into in [saved, merged] if merged.is_dir() else [saved]:
        tokenizer.save_pretrained(into)
        for name in {*tokenizer.vocab_files_names.values(), ADDED_TOKENS}:
            if (Path(base) / name).is_file() and not (into / name).exists():
                shutil.copy(Path(base) / name, into / name)
        if (into / "config.json").is_file() and (Path(base) / GENERATION_CONFIG).is_file():
            shutil.copy(Path(base) / GENERATION_CONFIG, into / GENERATION_CONFIG)
