"""The optional format reward helper."""

import pytest

from groupflow.core.records import Verdict
from groupflow.reward_workers.format_reward import (
    blend_format,
    check_format_weight,
    last_tagged_block,
)


def test_last_tagged_block():
    assert last_tagged_block("<answer>1</answer> x <ANSWER>\n2\n</ANSWER>") == "\n2\n"
    assert last_tagged_block("<answer>unclosed") is None
    assert last_tagged_block("<think>a</think>", tag="think") == "a"
    assert last_tagged_block("") is None


def test_blend_format():
    right, wrong = Verdict(1.0, "correct"), Verdict(0.0, "wrong", error="error")
    assert blend_format(right, False, 0.0) is right
    assert blend_format(right, True, 0.25) == Verdict(1.0, "correct; format ok")
    assert blend_format(right, False, 0.25).reward == pytest.approx(0.75)
    blended = blend_format(wrong, True, 0.25)
    assert blended.reward == pytest.approx(0.25)
    assert blended.error == "error"


def test_weight_must_be_a_fraction():
    assert check_format_weight("t", 0.5) == 0.5
    for bad in (-0.1, 1.1):
        with pytest.raises(ValueError, match="t: format_weight"):
            check_format_weight("t", bad)
