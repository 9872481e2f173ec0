"""Reward plugins: loading, sync/async calls, and every value or exception a plugin can
produce (in the scorer process; timeouts are the verifier pool's, see test_verifier_attacks)."""

import asyncio
import sys
import textwrap

import pytest

from groupflow.core.records import Prompt
from groupflow.reward_workers.plugins import RewardPlugin, call_plugin, load_plugin

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

    def huge(prompt, response, answer):
        return 10**400

    def interrupts(prompt, response, answer):
        raise KeyboardInterrupt

    class BadFloat(float):
        def __float__(self):
            raise RuntimeError("no float for you")

    def bad_float(prompt, response, answer):
        return BadFloat(0.5)

    class BadStr:
        def __str__(self):
            raise RuntimeError("no str for you")

    def bad_info(prompt, response, answer):
        return 1.0, BadStr()

    class BadError(Exception):
        def __str__(self):
            raise RuntimeError("no str for you")

    def raises_bad_error(prompt, response, answer):
        raise BadError()

    def infinite(prompt, response, answer):
        return float("inf")

    def triple(prompt, response, answer):
        return (1.0, "a", "b")
    """
)
PROMPT = Prompt("p1", "What is 6*7?", 42)


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def call(plugin: RewardPlugin, response: str, loop: asyncio.AbstractEventLoop):
    return call_plugin(plugin, PROMPT, response, loop)


@pytest.fixture
def plugin_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(PLUGIN_SOURCE)
    return path


def test_file_plugin_gets_prompt_response_and_answer(plugin_file, loop):
    plugin = load_plugin(f"{plugin_file}:exact")
    assert call(plugin, " 42 ", loop).reward == 1.0
    assert call(plugin, "41", loop).reward == 0.0
    module = sys.modules[plugin.function.__module__]
    assert module.calls == [("What is 6*7?", " 42 ", 42), ("What is 6*7?", "41", 42)]


def test_module_plugin(plugin_file, monkeypatch, loop):
    monkeypatch.syspath_prepend(str(plugin_file.parent))
    plugin = load_plugin("my_rewards:with_info")
    verdict = call(plugin, "x", loop)
    assert (verdict.reward, verdict.reason, verdict.error) == (0.5, "with_info: half marks", None)


def test_any_real_number_type_is_accepted(plugin_file, loop):
    verdict = call(load_plugin(f"{plugin_file}:fraction"), "x", loop)
    assert (verdict.reward, verdict.error) == (0.25, None)


def test_async_plugin(plugin_file, loop):
    plugin = load_plugin(f"{plugin_file}:async_exact")
    assert [call(plugin, r, loop).reward for r in ("42", "0", "42")] == [1.0, 0.0, 1.0]


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
        ("huge", "float() refuses: int too large to convert to float"),
        ("interrupts", "raised KeyboardInterrupt"),
        ("bad_float", "float() refuses: no float for you"),
        ("raises_bad_error", "raised BadError: <BadError whose str() raised>"),
        ("infinite", "returned inf, outside [0, 1]"),
        ("triple", "returned tuple, not a number"),
    ],
)
def test_failures_become_zero_reward_errors(plugin_file, function, reason, loop):
    verdict = call(load_plugin(f"{plugin_file}:{function}"), "42", loop)
    assert verdict.reward == 0.0
    assert verdict.error == "error"
    assert reason in verdict.reason


def test_an_info_whose_str_raises_still_gives_the_reward(plugin_file, loop):
    verdict = call(load_plugin(f"{plugin_file}:bad_info"), "42", loop)
    assert (verdict.reward, verdict.error) == (1.0, None)
    assert "whose str() raised" in verdict.reason


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", "expected 'module:name'"),
        ("module:", "expected 'module:name'"),
        ("/nowhere/plugin.py:f", "no such file"),
        ("surely_not_a_module_xyz:f", "import failed: ModuleNotFoundError"),
        ("json:no_such_function", "has no 'no_such_function'"),
        ("json:__doc__", "'__doc__' is not a function"),
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


@pytest.mark.parametrize(
    "body", ["raise SystemExit(0)", "raise KeyboardInterrupt", "import sys; sys.exit(3)"]
)
def test_plugin_exiting_at_import_is_a_load_error(tmp_path, body):
    path = tmp_path / "exits.py"
    path.write_text(body + "\n")
    with pytest.raises(ValueError, match="import failed") as err:
        load_plugin(f"{path}:f")
    assert "\n" not in str(err.value)
