"""Reward plugins: loading, sync/async calls, and every way a plugin can misbehave."""

import logging
import sys
import textwrap
import time

import pytest

from groupflow.records import Prompt
from groupflow.reward_workers.plugins import load_plugin

PLUGIN_SOURCE = textwrap.dedent(
    """
    import asyncio
    import time

    calls = []

    def exact(prompt, response, answer):
        calls.append((prompt, response, answer))
        return 1.0 if response.strip() == str(answer) else 0.0

    def with_info(prompt, response, answer):
        return 0.5, "half marks"

    def fraction(prompt, response, answer):
        from fractions import Fraction
        return Fraction(1, 4)

    async def async_exact(prompt, response, answer):
        await asyncio.sleep(0)
        return 1.0 if response.strip() == str(answer) else 0.0

    def raises(prompt, response, answer):
        raise KeyError("boom")

    def exits(prompt, response, answer):
        raise SystemExit(3)

    def text(prompt, response, answer):
        return "1.0"

    def nan(prompt, response, answer):
        return float("nan")

    def too_big(prompt, response, answer):
        return 1.5

    def boolean(prompt, response, answer):
        return True

    def nothing(prompt, response, answer):
        return None

    def hangs(prompt, response, answer):
        time.sleep(1.0)
        return 1.0

    async def async_hangs(prompt, response, answer):
        await asyncio.sleep(10)
        return 1.0

    async def blocks_loop(prompt, response, answer):
        time.sleep(1.0)
        return 1.0
    """
)
PROMPT = Prompt("p1", "What is 6*7?", 42)


@pytest.fixture
def plugin_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(PLUGIN_SOURCE)
    return path


def test_file_plugin_gets_prompt_response_and_answer(plugin_file):
    plugin = load_plugin(f"{plugin_file}:exact")
    assert plugin(PROMPT, " 42 ").reward == 1.0
    assert plugin(PROMPT, "41").reward == 0.0
    module = sys.modules[plugin.function.__module__]
    assert module.calls == [("What is 6*7?", " 42 ", 42), ("What is 6*7?", "41", 42)]


def test_module_plugin(plugin_file, monkeypatch):
    monkeypatch.syspath_prepend(str(plugin_file.parent))
    plugin = load_plugin("my_rewards:with_info")
    verdict = plugin(PROMPT, "x")
    assert (verdict.reward, verdict.reason, verdict.error) == (0.5, "with_info: half marks", None)


def test_any_real_number_type_is_accepted(plugin_file):
    verdict = load_plugin(f"{plugin_file}:fraction")(PROMPT, "x")
    assert (verdict.reward, verdict.error) == (0.25, None)


def test_async_plugin(plugin_file):
    plugin = load_plugin(f"{plugin_file}:async_exact")
    assert [plugin(PROMPT, r).reward for r in ("42", "0", "42")] == [1.0, 0.0, 1.0]


@pytest.mark.parametrize(
    ("function", "reason"),
    [
        ("raises", "raised KeyError: 'boom'"),
        ("exits", "raised SystemExit: 3"),
        ("text", "returned str, not a number"),
        ("nan", "returned nan, outside [0, 1]"),
        ("too_big", "returned 1.5, outside [0, 1]"),
        ("boolean", "returned bool, not a number"),
        ("nothing", "returned NoneType, not a number"),
    ],
)
def test_failures_become_zero_reward_errors(plugin_file, function, reason):
    verdict = load_plugin(f"{plugin_file}:{function}")(PROMPT, "42")
    assert verdict.reward == 0.0
    assert verdict.error == "error"
    assert reason in verdict.reason


@pytest.mark.parametrize("function", ["hangs", "async_hangs", "blocks_loop"])
def test_timeouts_do_not_block_the_caller(plugin_file, function):
    plugin = load_plugin(f"{plugin_file}:{function}", timeout_s=0.2)
    start = time.monotonic()
    verdict = plugin(PROMPT, "42")
    elapsed = time.monotonic() - start
    assert verdict.error == "timeout"
    assert verdict.reward == 0.0
    assert elapsed < 0.7


def test_an_async_plugin_recovers_after_blocking_its_loop(plugin_file):
    plugin = load_plugin(f"{plugin_file}:blocks_loop", timeout_s=0.2)
    assert plugin(PROMPT, "42").error == "timeout"
    plugin.function = load_plugin(f"{plugin_file}:async_exact").function
    assert plugin(PROMPT, "42").reward == 1.0


def test_each_kind_of_failure_is_logged_once(plugin_file, caplog):
    plugin = load_plugin(f"{plugin_file}:raises")
    with caplog.at_level(logging.WARNING, logger="groupflow.reward_workers.plugins"):
        for _ in range(3):
            plugin(PROMPT, "42")
        plugin.function = lambda *args: "not a number"
        plugin(PROMPT, "42")
        plugin(PROMPT, "42")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1  # "error" covers raising and bad values alike
    assert "raised KeyError" in messages[0]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", "expected 'module:function'"),
        ("module:", "expected 'module:function'"),
        ("/nowhere/plugin.py:f", "no such file"),
        ("surely_not_a_module_xyz:f", "import failed: ModuleNotFoundError"),
        ("json:no_such_function", "has no function 'no_such_function'"),
        ("json:__doc__", "has no function '__doc__'"),
    ],
)
def test_load_errors_are_one_line(spec, message):
    with pytest.raises(ValueError, match=message) as err:
        load_plugin(spec)
    assert "\n" not in str(err.value)


def test_plugin_failing_at_import_is_a_load_error(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('cannot start')\n")
    with pytest.raises(ValueError, match="import failed: RuntimeError: cannot start"):
        load_plugin(f"{path}:f")
