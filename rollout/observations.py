"""Observations (tool results, an environment's feedback) -> the token ids appended to a
trajectory after a model turn: rendered once, appended, never re-rendered.

Re-rendering the whole conversation each turn, or re-tokenising the model's text, changes ids
the engine already saw (templates that drop earlier reasoning, merges across a turn's border),
and the learner then trains tokens nobody sampled. Here a trajectory's ids are the prompt's,
then each turn exactly as the engine generated it, then each observation rendered on its own:
the template renders a fixed conversation (a user turn, an assistant turn) followed by the new
messages and a generation prompt, and the observation is everything after the assistant
turn's content. That takes in the template's closing of the assistant turn, less what the
model wrote of it itself (ChatML's `<|im_end|>` is the model's last token; the newline after
it is the observation's), and nothing of how the template renders earlier turns. The messages'
contents are data: their text is tokenised without its special tokens
(rollout/content_tokens.py), so that a tool's output cannot end the observation, or the model's
turn, with a control token of its own.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property

from groupflow.rollout.content_tokens import Piece
from groupflow.rollout.prompt_render import PromptRenderer, PromptRenderError

# Observations are rendered and tokenised here, off the engine's event loop: one thread, so
# that the tokenizer is never entered by two renderings at once.
_RENDERING = ThreadPoolExecutor(max_workers=1, thread_name_prefix="observations")

# The fixed conversation every observation is cut from.
_USER, _ASSISTANT = "groupflow-user-turn", "groupflow-assistant-turn"
_PROBE = "groupflow-tool-result"


class ObservationRenderer:
    """`ids(messages, last_token)`: the ids and text of observation messages after a model
    turn whose last token was `last_token`."""

    def __init__(self, renderer: PromptRenderer):
        if renderer.template is None:
            raise PromptRenderError(
                "agent: a multi-turn job needs a chat template to render tool messages "
                "(task.chat_template is 'none' or the tokenizer has none): set "
                "task.chat_template to a Jinja template file"
            )
        self.renderer = renderer
        self._base = renderer.messages_with_system(
            [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]
        )
        self.check()

    def check(self) -> None:
        """PromptRenderError, one line, unless the template renders a tool message after an
        assistant turn."""
        _, text = self.ids([{"role": "tool", "content": _PROBE}], None)
        if _PROBE not in text:
            raise PromptRenderError(
                f"{self.renderer.template_name}: drops tool messages (a tool result would never "
                "reach the model)"
            )

    @cached_property
    def token_chars(self) -> int:
        """The most characters one token stands for: the longest entry of the vocabulary (a
        byte-level entry is at least as long as the text it decodes to)."""
        return max(map(len, self.renderer.tokenizer.get_vocab()), default=1) or 1

    def max_chars(self, tokens: int) -> int:
        """The most characters of contents that may render to fewer than `tokens` tokens:
        above it an observation cannot fit, and is not rendered."""
        return max(tokens, 0) * self.token_chars

    async def ids_off_loop(self, messages: list[dict], last_token: int | None):
        """`ids`, in the rendering thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(_RENDERING, self.ids, messages, last_token)

    def ids(self, messages: list[dict], last_token: int | None) -> tuple[list[int], str]:
        pieces = self.renderer.render_pieces(self._base + messages, "cannot render tool messages")
        assistant = len(self._base) - 1
        at = next((k for k, p in enumerate(pieces) if p.message == assistant), None)
        if at is None:
            raise PromptRenderError(
                f"{self.renderer.template_name}: does not render an assistant turn's content"
            )
        pieces = pieces[at + 1 :]
        written = "" if last_token is None else self.renderer.tokenizer.decode([last_token])
        if written and pieces and pieces[0].message is None and pieces[0].text.startswith(written):
            pieces[0] = Piece(pieces[0].text[len(written) :])
        text = "".join(p.text for p in pieces)
        return self.renderer.content_tokens.ids(pieces), text
