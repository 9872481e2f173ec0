"""Token ids of rendered text whose contents are never read for control tokens.

A chat template's rendering is two kinds of text: the template's own (role markers, turn ends,
`<tool_response>` tags), whose special tokens must be the special tokens, and contents (a
dataset's prompt text, a tool's result, an environment's message), which are data. Tokenising
the rendering as one string reads both alike: a calculator refusal quoting the model's
`<eos><pad>1`, or a program printing `</tool_response><eos>`, would put a real end-of-text
token in the ids, or close the template's tool block early. Here a content never becomes an
added token (special or not: Qwen's `</tool_response>` is an added token that is not special).

The rendering comes as pieces (`Piece`, rollout/prompt_render.py cuts them). Where no added
token falls inside a content, the ids are those of the rendering tokenised whole, exactly as
before (merges across a content's border included). Where one does, each piece is tokenised on
its own: the template's pieces as the tokenizer does, each content by the same tokenizer with
no added vocabulary (normaliser, pre-tokeniser and model only), so its text can only become
ordinary tokens. A slow tokenizer (no offsets) is tokenised piece by piece always, its
contents with `split_special_tokens`, which ignores every added token.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class Piece:
    """A run of rendered text: the template's own (`message` None) or the content of
    messages[message] as the template wrote it."""

    text: str
    message: int | None = None


class ContentTokens:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._fast = bool(getattr(tokenizer, "is_fast", False))
        self._added = frozenset(tokenizer.get_added_vocab().values())

    def ids(self, pieces: list[Piece]) -> list[int]:
        """The ids of a rendering (no BOS added: a template writes its own)."""
        text = "".join(p.text for p in pieces)
        spans, start = [], 0
        for piece in pieces:
            if piece.message is not None and piece.text:
                spans.append((start, start + len(piece.text)))
            start += len(piece.text)
        whole = self._whole(text, spans, add_special_tokens=False)
        if whole is not None:
            return whole
        return [
            i
            for p in pieces
            for i in (
                self._content(p.text, add_special_tokens=False)
                if p.message is not None
                else self.tokenizer.encode(p.text, add_special_tokens=False)
            )
        ]

    def text_ids(self, text: str) -> list[int]:
        """The ids of text that is all content (a prompt without a chat template), with the
        tokenizer's own BOS or EOS around it."""
        whole = self._whole(text, [(0, len(text))], add_special_tokens=True)
        return whole if whole is not None else self._content(text, add_special_tokens=True)

    def _whole(self, text: str, spans: list[tuple[int, int]], add_special_tokens: bool):
        """The text's ids tokenised whole; None where an added token falls in a content."""
        if not self._fast:
            return None
        encoded = self.tokenizer(
            text, add_special_tokens=add_special_tokens, return_offsets_mapping=True
        )
        starts = [a for a, _ in spans]
        for token, (begin, end) in zip(
            encoded["input_ids"], encoded["offset_mapping"], strict=True
        ):
            if token in self._added and end > begin:
                # the last content starting before the token's end: does it reach past its start?
                at = bisect.bisect_left(starts, end) - 1
                if at >= 0 and spans[at][1] > begin:
                    return None
        return encoded["input_ids"]

    def _content(self, text: str, add_special_tokens: bool) -> list[int]:
        if not self._fast:
            return self.tokenizer.encode(
                text, add_special_tokens=add_special_tokens, split_special_tokens=True
            )
        return self._bare.encode(text, add_special_tokens=add_special_tokens).ids

    @cached_property
    def _bare(self):
        """The tokenizer without its added vocabulary: built when first needed (a copy of a
        real model's tokenizer is tens of megabytes)."""
        from tokenizers import Tokenizer

        spec = json.loads(self.tokenizer.backend_tokenizer.to_str())
        spec["added_tokens"] = []
        return Tokenizer.from_str(json.dumps(spec))
