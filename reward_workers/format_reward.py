"""Optional format reward: a share of the reward for putting the answer where it belongs.

Any task can blend it in: reward = (1 - weight) * correctness + weight * well_formatted.
With weight 0 (every task's default) the verdict is unchanged.
"""

from __future__ import annotations

import re

from groupflow.records import Verdict


def check_format_weight(task: str, weight: float) -> float:
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"{task}: format_weight must be in [0, 1] (got {weight})")
    return float(weight)


def last_tagged_block(text: str, tag: str = "answer") -> str | None:
    """The content of the last <tag>...</tag> block, or None when there is none."""
    blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.DOTALL | re.IGNORECASE)
    return blocks[-1] if blocks else None


def blend_format(verdict: Verdict, well_formatted: bool, weight: float) -> Verdict:
    if weight == 0.0:
        return verdict
    reward = (1.0 - weight) * verdict.reward + weight * float(well_formatted)
    note = "format ok" if well_formatted else "format missing"
    return Verdict(reward, f"{verdict.reason}; {note}", verdict.error)
