"""A response as its reader sees it, for verifiers that find the answer by a marker (`answer`,
`<answer>`, `\\boxed`).

A marker the model writes in letters that only look like ASCII (Cyrillic а, Greek ο), in
fullwidth forms, or with invisible characters inside (a zero-width space, a combining mark)
is one a reader sees and a plain search does not: a second answer the hedge rules never
count, or a last answer the verifier never reads. Verifiers therefore look for markers in the
normalised text (`normalised`), where each letter of a marker may also be any letter outside
ASCII (`lookalike`), and refuse a response whose markers a plain search would miscount
(`disguised`).
"""

from __future__ import annotations

import re
import unicodedata

_INVISIBLE = ("Cf", "Mn", "Me")  # zero-width joiners and spaces, bidi marks; combining marks


def normalised(text: str) -> str:
    """What a reader sees: compatibility forms folded (NFKC: fullwidth ａｎｓｗｅｒ, ligatures),
    invisible format characters and combining marks dropped, case folded."""
    text = unicodedata.normalize("NFKC", text)
    return "".join(c for c in text if unicodedata.category(c) not in _INVISIBLE).casefold()


def lookalike(marker: str) -> str:
    """A pattern of `marker` (lower case) in normalised text: each ASCII letter of it either
    itself or any letter outside ASCII, which may look just like it."""
    return "".join(
        rf"(?:{re.escape(c)}|[^\W\d_\x00-\x7f])" if c.isascii() and c.isalpha() else re.escape(c)
        for c in marker
    )


def disguised(text: str, marker: str) -> bool:
    """Whether `text` holds `marker` in a form a reader sees as it and a case-blind plain
    search does not find."""
    seen = len(re.findall(lookalike(marker.casefold()), normalised(text)))
    return seen > text.casefold().count(marker.casefold())
