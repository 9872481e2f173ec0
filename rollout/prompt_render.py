"""Prompts -> the token ids the policy sees, through the tokenizer's chat template when it has
one (`task.chat_template`, `task.system_prompt`).

The engine renders every prompt once and hands the ids on with its samples, so the learner
trains on exactly the ids vLLM generated from: no second rendering can drift from the first.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from groupflow.records import Prompt


class PromptRenderError(ValueError):
    """A prompt or setting the tokenizer cannot render, reported as one line."""


@dataclass
class ChatSettings:
    chat_template: str = "auto"  # "auto" | "none" | a path to a Jinja template file
    system_prompt: str | None = None


class PromptRenderer:
    """Renders a Prompt to ids: chat messages through the template, or its raw text."""

    def __init__(self, tokenizer, settings: ChatSettings):
        self.tokenizer = tokenizer
        self.system_prompt = settings.system_prompt
        self.template = _template(tokenizer, settings.chat_template)
        if self.template is None and settings.system_prompt is not None:
            raise PromptRenderError(
                "task.system_prompt: needs a chat template, and the tokenizer has none "
                "(set task.chat_template to a template file)"
            )

    @property
    def uses_chat(self) -> bool:
        return self.template is not None

    def messages(self, prompt: Prompt) -> list[dict]:
        """The conversation a chat model sees: the system prompt, then the prompt's turns (a
        task's chat wording when it has one, else its text as one user turn)."""
        turns = prompt.messages or [{"role": "user", "content": prompt.text}]
        if self.system_prompt is not None and turns[0].get("role") != "system":
            turns = [{"role": "system", "content": self.system_prompt}, *turns]
        return turns

    def ids(self, prompt: Prompt) -> list[int]:
        if self.template is None:
            if not prompt.text:
                raise PromptRenderError(
                    f"prompt {prompt.uid!r}: is only a list of messages, and the tokenizer has "
                    "no chat template (set task.chat_template)"
                )
            return self.tokenizer.encode(prompt.text)
        text = self.tokenizer.apply_chat_template(
            self.messages(prompt),
            chat_template=self.template,
            add_generation_prompt=True,
            tokenize=False,
        )
        # The template writes any BOS itself; the tokenizer must not add a second one.
        return self.tokenizer.encode(text, add_special_tokens=False)


def _template(tokenizer, choice: str) -> str | None:
    if choice == "none":
        return None
    if choice == "auto":
        return getattr(tokenizer, "chat_template", None) or None
    path = Path(choice)
    try:
        return path.read_text()
    except OSError as err:
        raise PromptRenderError(
            f"task.chat_template: cannot read {path} ({err.strerror})"
        ) from None
