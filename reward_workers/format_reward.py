"""Optional format reward: a share of the reward for putting the answer where it belongs.

Any task can blend it in: reward = (1 - weight) * correctness + weight * well_formatted.
With weight 0 (every task's default) the verdict is unchanged.
"""

from __future__ import annotations

from groupflow.core.records import Verdict
from groupflow.reward_workers.reader_view import disguised
from groupflow.reward_workers.tasks.options import check_number

# Answers sit at the end of a response; extraction looks no further back than this.
MAX_EXTRACTION_CHARS = 20_000


def check_format_weight(task: str, weight: float) -> float:
    return check_number(task, "format_weight", weight, 0.0, 1.0)


def last_tagged_block(text: str, tag: str = "answer") -> str | None:
    """The content of the last <tag>...</tag> block in the response's last
    MAX_EXTRACTION_CHARS, or None when there is none. Linear time: the last closing tag,
    then the last opening tag before it."""
    text = text[-MAX_EXTRACTION_CHARS:]
    lowered = text.lower()
    close = lowered.rfind(f"</{tag}>")
    if close < 0:
        return None
    start = lowered.rfind(f"<{tag}>", 0, close)
    if start < 0:
        return None
    return text[start + len(tag) + 2 : close]


def disguised_tag(text: str, tag: str = "answer") -> Verdict | None:
    """A zero verdict where the response holds an <tag> or </tag> a reader sees and
    last_tagged_block cannot (reward_workers/reader_view.py): the block it would read is then
    not the one a reader takes for the answer. None where every tag is plain."""
    if disguised(text, f"<{tag}>") or disguised(text, f"</{tag}>"):
        return Verdict(0.0, f"a disguised <{tag}> tag: the answer is not where it seems")
    return None


def blend_format(verdict: Verdict, well_formatted: bool, weight: float) -> Verdict:
    if weight == 0.0:
        return verdict
    reward = (1.0 - weight) * verdict.reward + weight * float(well_formatted)
    note = "format ok" if well_formatted else "format missing"
    return Verdict(reward, f"{verdict.reason}; {note}", verdict.error)
