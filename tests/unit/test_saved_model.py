"""A saved policy is a complete model directory (groupflow/loop/saved_model.py): loaded alone, its
tokenizer renders a chat exactly as the base's did, whatever format the base's tokenizer came in,
with the template the job trained with."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from groupflow.core.adapters import MERGED_DIR
from groupflow.loop.saved_model import complete_saved_model
from groupflow.run.quickstart import build_tokenizer

CONVERSATION = [
    {"role": "system", "content": "answer with a number"},
    {"role": "user", "content": "What is 12 plus 30?"},
    {"role": "assistant", "content": "42"},
    {"role": "user", "content": "And 7 plus 5?"},
]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GENERATION_CONFIG = {"eos_token_id": [2, 3], "temperature": 0.7, "top_p": 0.8}


def _corpus() -> list[str]:
    rng = random.Random(0)
    return [
        f"What is {rng.randrange(10**4)} plus {rng.randrange(10**4)}? answer with a number "
        f"{rng.randrange(10**5)}"
        for _ in range(500)
    ]


def template_in_jinja(base: Path) -> None:
    """A tokenizer.json tokenizer whose template transformers keeps in chat_template.jinja."""
    build_tokenizer("?<|>_\n", chat_template=TEMPLATE).save_pretrained(base)
    assert (base / "chat_template.jinja").is_file()


def vocab_and_merges(base: Path) -> None:
    """A byte-level BPE known only by vocab.json and merges.txt (GPT-2's layout), its special
    tokens in added_tokens.json, its template in chat_template.jinja."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.train_from_iterator(
        _corpus(),
        trainers.BpeTrainer(
            vocab_size=400,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    core.model.save(str(base))
    size = core.get_vocab_size()
    (base / "added_tokens.json").write_text(
        json.dumps({"<|endoftext|>": size, "<|im_start|>": size + 1, "<|im_end|>": size + 2})
    )
    (base / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|im_end|>"})
    )
    (base / "chat_template.jinja").write_text(TEMPLATE)


def sentencepiece_model(base: Path) -> None:
    """A SentencePiece tokenizer known only by tokenizer.model (Llama's layout)."""
    import sentencepiece as spm

    (base / "corpus.txt").write_text("\n".join(_corpus()))
    spm.SentencePieceTrainer.train(
        input=str(base / "corpus.txt"),
        model_prefix=str(base / "tokenizer"),
        vocab_size=80,
        model_type="bpe",
        user_defined_symbols=["<|im_start|>", "<|im_end|>"],
        minloglevel=2,
    )
    for name in ("corpus.txt", "tokenizer.vocab"):
        (base / name).unlink()
    (base / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "LlamaTokenizer", "eos_token": "</s>"})
    )
    (base / "chat_template.jinja").write_text(TEMPLATE)


# format -> (its builder, the model type of its config.json, the base's files kept as they are)
FORMATS = {
    "chat_template.jinja": (template_in_jinja, "qwen2", set()),
    "vocab.json/merges.txt": (
        vocab_and_merges,
        "gpt2",
        {"vocab.json", "merges.txt", "added_tokens.json"},
    ),
    "tokenizer.model": (sentencepiece_model, "llama", {"tokenizer.model"}),
}


def base_and_saved(tmp_path: Path, make_tokenizer, model_type: str = "qwen2") -> tuple[Path, Path]:
    """A base model directory (its tokenizer, config.json and generation_config.json), and a
    policy saved from it as the learner writes one: weights and config, no tokenizer."""
    base, saved = tmp_path / "base", tmp_path / "saved"
    base.mkdir()
    saved.mkdir()
    make_tokenizer(base)
    for into in (base, saved):
        (into / "config.json").write_text(json.dumps({"model_type": model_type}))
    (base / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    (saved / "generation_config.json").write_text(json.dumps({"temperature": 1.0}))
    return base, saved


def rendered(model_dir: Path, chat_template: str | None = None) -> tuple[str, list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template(
        CONVERSATION, chat_template=chat_template, add_generation_prompt=True, tokenize=False
    )
    return text, tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_saved_policy_renders_the_chat_as_its_base(fmt, tmp_path):
    make_tokenizer, model_type, vocabulary_files = FORMATS[fmt]
    base, saved = base_and_saved(tmp_path, make_tokenizer, model_type)
    complete_saved_model(str(base), saved, "auto")
    text, ids = rendered(saved)
    assert (text, ids) == rendered(base)
    assert text.startswith("<|im_start|>system\nanswer with a number<|im_end|>")
    assert len(ids) < len(text)  # ids of the tokenizer, not one per character of a fallback
    # the base's own vocabulary files too, for tools that read them rather than tokenizer.json
    for name in vocabulary_files:
        assert (saved / name).read_bytes() == (base / name).read_bytes(), name
    assert json.loads((saved / "generation_config.json").read_text()) == GENERATION_CONFIG


def test_a_job_template_file_is_the_saved_template(tmp_path):
    """A job that rendered with its own template (task.chat_template: a file) saves that one,
    not the base's."""
    base, saved = base_and_saved(tmp_path, template_in_jinja)
    own = tmp_path / "own.jinja"
    own.write_text(
        "{% for m in messages %}{{ m.role | upper }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
    )
    complete_saved_model(str(base), saved, str(own))
    assert rendered(saved) == rendered(base, own.read_text())
    assert rendered(saved)[0].startswith("SYSTEM: answer with a number\n")


def test_a_job_that_rendered_raw_text_saves_no_template(tmp_path):
    """task.chat_template: none trained on raw text, so the saved model has no template that
    a server would wrap prompts in."""
    base, saved = base_and_saved(tmp_path, template_in_jinja)
    complete_saved_model(str(base), saved, "none")
    assert AutoTokenizer.from_pretrained(base).chat_template
    assert AutoTokenizer.from_pretrained(saved).chat_template is None
    assert not (saved / "chat_template.jinja").exists()


def test_a_lora_save_completes_the_adapter_and_its_merged_model(tmp_path):
    """With LoRA the saved policy is an adapter (no config.json) with the merged model inside:
    both get the tokenizer, the merged model the generation config."""
    base, merged = base_and_saved(tmp_path, template_in_jinja)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    shutil.move(merged, adapter / MERGED_DIR)
    complete_saved_model(str(base), adapter, "auto")
    for saved in (adapter, adapter / MERGED_DIR):
        assert rendered(saved) == rendered(base), saved
    assert not (adapter / "generation_config.json").exists()
    merged_config = json.loads((adapter / MERGED_DIR / "generation_config.json").read_text())
    assert merged_config == GENERATION_CONFIG
