"""Multi-turn trajectories without an engine: token in, token out, limits, end reasons, tools
and their failures (rollout/trajectory.py, rollout/toolbox.py and the built-in tools,
rollout/observations.py)."""

from __future__ import annotations

import asyncio
import random
import time
from fractions import Fraction

import numpy as np
import pytest
import ray

from groupflow.actors.tools import ToolPoolClient, in_process_run_code
from groupflow.core.records import Prompt, Response, SampledGroup, ToolUse, Verdict
from groupflow.loop.sequences import group_advantages, train_sequences
from groupflow.observe.rollout_figures import agent_figures
from groupflow.observe.sample_log import sample_rows
from groupflow.reward_workers.scorer import scored_groups
from groupflow.reward_workers.tasks.tool_arithmetic import (
    CHAT_TEMPLATE,
    ToolArithmeticTask,
    tool_call_text,
)
from groupflow.rollout.calculator_tool import Calculator
from groupflow.rollout.observations import ObservationRenderer
from groupflow.rollout.prompt_render import ChatSettings, PromptRenderer, PromptRenderError
from groupflow.rollout.python_tool import PythonTool
from groupflow.rollout.toolbox import ToolBox, ToolCall, ToolCallParser, ToolError
from groupflow.rollout.trajectory import ToolEnvironment, TurnLimits, run_trajectory
from groupflow.run.job_config import build_config
from groupflow.run.quickstart import build_tokenizer

TASK = ToolArithmeticTask()
EXTRA = TASK.EXTRA_CHARACTERS
# Templates in the built-in tokenizer's alphabet. The second closes an assistant turn with a
# tag the model does not write; the third drops the reasoning of earlier assistant turns (as
# reasoning models' templates do), so a re-render of the whole conversation changes the ids
# of earlier turns: the append-only trap.
TAGGED = (
    "{%- for m in messages -%}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<assistant>{%- endif -%}"
)
FORGETFUL = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and not loop.last -%}<a>{{ m.content.split('</think>')[-1] }}</a>"
    "{%- else -%}<{{ m.role[0] }}>{{ m.content }}</{{ m.role[0] }}>{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}<a>{%- endif -%}"
)
TEMPLATES = {"tool_arithmetic": CHAT_TEMPLATE, "tagged": TAGGED, "forgetful": FORGETFUL}


def renderer_for(template: str) -> PromptRenderer:
    tokenizer = build_tokenizer(EXTRA, template)
    return PromptRenderer(tokenizer, ChatSettings(tools=ToolBox([Calculator()], 5, 100).schemas))


class ScriptedEngine:
    """Turns from a script, tokenised here as the engine would sample them, ending with the
    end-of-text token; every request's ids are kept."""

    def __init__(self, tokenizer, turns: list[str], version_of_turn=lambda turn: 0):
        self.tokenizer, self.turns, self.version_of_turn = tokenizer, turns, version_of_turn
        self.requests: list[list[int]] = []
        self.generated: list[list[int]] = []

    async def __call__(self, ids: list[int], max_tokens: int, turn: int) -> Response:
        self.requests.append(list(ids))
        ids_out = self.tokenizer.encode(self.turns[turn]) + [self.tokenizer.eos_token_id]
        finish = "stop"
        if len(ids_out) > max_tokens:
            ids_out, finish = ids_out[:max_tokens], "length"
        self.generated.append(ids_out)
        logprobs = [-random.random() for _ in ids_out]
        text = self.tokenizer.decode(ids_out, skip_special_tokens=True)
        return Response(ids_out, text, logprobs, finish, [(self.version_of_turn(turn), 0)])


def run(
    renderer,
    engine,
    environment=None,
    limits=None,
    prompt=None,
    context=256,
):
    prompt = prompt or next(TASK.train_prompts(seed=random.randrange(10**6)))
    limits = limits or TurnLimits(4, 128, 240, 30.0)
    box = ToolBox([Calculator()], 5.0, 200)
    parser = ToolCallParser("hermes", renderer.tokenizer, box.schemas)
    observations = ObservationRenderer(renderer)
    environment = environment or (lambda p: ToolEnvironment(p, box, parser))
    prompt_ids = renderer.ids(prompt)
    coro = run_trajectory(prompt, prompt_ids, engine, environment, observations, limits, context)
    return prompt, prompt_ids, asyncio.run(coro)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_trained_ids_are_the_generated_and_inserted_ids_exactly(name):
    renderer = renderer_for(TEMPLATES[name])
    tokenizer = renderer.tokenizer
    prompt = next(TASK.train_prompts(seed=random.randrange(10**6)))
    call = "<think>a long product</think>" + tool_call_text(prompt.uid)
    engine = ScriptedEngine(tokenizer, [call, str(prompt.answer)])
    _, prompt_ids, response = run(renderer, engine, prompt=prompt)
    assert (response.end_reason, response.turns) == ("answer", 2)
    first, second = engine.generated
    inserted = response.token_ids[len(first) : len(response.token_ids) - len(second)]
    assert response.token_ids == first + inserted + second
    assert response.loss_mask == [1] * len(first) + [0] * len(inserted) + [1] * len(second)
    assert str(prompt.answer) in tokenizer.decode(inserted)  # the calculator's result
    # each turn was sampled on exactly the ids trained before it
    assert engine.requests == [prompt_ids, prompt_ids + first + inserted]
    assert len(response.logprobs) == sum(response.loss_mask)
    if name == "tool_arithmetic":  # the task reads its own template's tool responses
        assert TASK.verify(prompt, response.answer_text).reward == 1.0
    # the trap: rendering the whole conversation again gives other ids for the forgetful one
    conversation = renderer.messages(prompt) + [
        {"role": "assistant", "content": call},
        {"role": "tool", "content": str(prompt.answer)},
    ]
    again = tokenizer.apply_chat_template(
        conversation, chat_template=renderer.template, add_generation_prompt=True, tokenize=False
    )
    rerendered = tokenizer.encode(again, add_special_tokens=False)
    assert (rerendered == engine.requests[1]) == (name == "tool_arithmetic")


# A ChatML template of the Qwen kind (written here): tool results go back as a user turn in
# <tool_response> tags, and the tools are declared in a system turn.
CHATML = (
    "{%- if tools -%}<|im_start|>system{{ '\\n' }}"
    "{%- for t in tools -%}{{ t | tojson }}{{ '\\n' }}{%- endfor -%}<|im_end|>{{ '\\n' }}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}<|im_start|>user{{ '\\n' }}<tool_response>{{ '\\n' }}"
    "{{ m.content }}{{ '\\n' }}</tool_response><|im_end|>{{ '\\n' }}"
    "{%- else -%}<|im_start|>{{ m.role }}{{ '\\n' }}{{ m.content }}<|im_end|>{{ '\\n' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant{{ '\\n' }}{%- endif -%}"
)


def bpe_tokenizer():
    """A byte-level BPE tokenizer trained here on text like the task's: merges across
    characters, ChatML's special tokens, the call markers as plain added tokens (as Qwen's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = [
        f"{rng.randrange(10**4)}*{rng.randrange(10**4)}={rng.randrange(10**8)} "
        + tool_call_text(f"{rng.randrange(10**4)}*{rng.randrange(10**4)}")
        + " the product of the numbers is"
        for _ in range(2000)
    ]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=800,
            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    tokenizer.chat_template = CHATML
    return tokenizer


def test_a_merging_tokenizer_under_chatml_keeps_the_ids_exact():
    """The rollout side with a byte-level BPE tokenizer and a ChatML template: tokens merge,
    the model's turn ends with <|im_end|>, and the observation starts after it."""
    tokenizer = bpe_tokenizer()
    renderer = PromptRenderer(
        tokenizer, ChatSettings(tools=ToolBox([Calculator()], 5, 100).schemas)
    )
    prompt = next(TASK.train_prompts(seed=random.randrange(10**6)))
    call = "Let me multiply. " + tool_call_text(prompt.uid)
    engine = ScriptedEngine(tokenizer, [call, f"The product is {prompt.answer}."])
    _, prompt_ids, response = run(renderer, engine, prompt=prompt, context=4096)
    assert (response.end_reason, response.turns) == ("answer", 2)
    first, second = engine.generated
    assert len(tokenizer.encode(call)) < len(call) / 2  # BPE merges: far fewer ids than chars
    inserted = response.token_ids[len(first) : len(response.token_ids) - len(second)]
    assert response.token_ids == first + inserted + second
    assert response.loss_mask == [1] * len(first) + [0] * len(inserted) + [1] * len(second)
    assert engine.requests == [prompt_ids, prompt_ids + first + inserted]
    # the observation closes nothing the model closed itself and opens the next assistant turn
    assert first[-1] == tokenizer.eos_token_id
    observation = f"\n<|im_start|>user\n<tool_response>\n{prompt.answer}\n</tool_response>"
    assert tokenizer.decode(inserted) == observation + "<|im_end|>\n<|im_start|>assistant\n"
    # the whole trajectory reads as the conversation rendered in one piece, less the newline
    # after the last <|im_end|>, which a next observation would carry
    whole = tokenizer.decode(prompt_ids + response.token_ids) + "\n"
    conversation = renderer.messages(prompt) + [
        {"role": "assistant", "content": call},
        {"role": "tool", "content": str(prompt.answer)},
        {"role": "assistant", "content": f"The product is {prompt.answer}."},
    ]
    assert whole == tokenizer.apply_chat_template(
        conversation, chat_template=renderer.template, tools=renderer.tools, tokenize=False
    )


def test_versions_of_turns_are_placed_where_each_turn_starts():
    renderer = renderer_for(CHAT_TEMPLATE)
    prompt = next(TASK.train_prompts(seed=3))
    engine = ScriptedEngine(
        renderer.tokenizer, [tool_call_text(prompt.uid), str(prompt.answer)], lambda t: 5 + t
    )
    _, _, response = run(renderer, engine, prompt=prompt)
    second_start = len(response.token_ids) - len(engine.generated[1])
    assert response.versions == [(5, 0), (6, second_start)]


@pytest.mark.parametrize(
    ("turns", "limits", "reason"),
    [
        (["<tool_call>{bad json</tool_call>", "12"], TurnLimits(4, 96, 240, 30), "answer"),
        ([tool_call_text("1*2")] * 5, TurnLimits(2, 96, 240, 30), "turn_limit"),
        (["9" * 50], TurnLimits(3, 20, 240, 30), "token_limit"),
        ([tool_call_text("1*2")] * 5, TurnLimits(9, 96, 120, 30), "token_limit"),
    ],
)
def test_each_limit_ends_the_trajectory_and_says_so(turns, limits, reason):
    renderer = renderer_for(CHAT_TEMPLATE)
    _, prompt_ids, response = run(renderer, ScriptedEngine(renderer.tokenizer, turns), None, limits)
    assert response.end_reason == reason
    assert response.turns <= limits.max_turns
    assert len(response.token_ids) <= limits.total_tokens
    assert len(response.token_ids) == len(response.loss_mask)
    if reason == "token_limit" and limits.turn_tokens == 20:
        assert response.finish_reason == "length"


def test_a_malformed_call_and_an_unknown_tool_are_errors_the_model_reads():
    renderer = renderer_for(CHAT_TEMPLATE)
    unknown = '<tool_call>{"name":"oracle","arguments":{}}</tool_call>'
    turns = ["<tool_call>{not json</tool_call>", unknown, "7"]
    limits = TurnLimits(4, 128, 1000, 30.0)
    _, _, response = run(
        renderer, ScriptedEngine(renderer.tokenizer, turns), None, limits, context=1024
    )
    assert [u.outcome for u in response.tool_uses] == ["malformed", "unknown"]
    assert "not valid JSON" in response.text and "no tool 'oracle'" in response.text
    assert response.end_reason == "answer" and response.turns == 3


class Raising:
    def __init__(self, prompt):
        pass

    def step(self, turn):
        raise RuntimeError("the environment broke")


class Slow:
    def __init__(self, prompt):
        pass

    async def step(self, turn):
        await asyncio.sleep(10)


class Blocking:  # sync and slow: runs in a thread, so the deadline can still end it
    def __init__(self, prompt):
        pass

    def step(self, turn):
        time.sleep(1.0)


class TimingOut:  # a TimeoutError of its own is its error, not the deadline
    def __init__(self, prompt):
        pass

    async def step(self, turn):
        raise TimeoutError("the simulator did not answer")


class Wrong:
    def __init__(self, prompt):
        pass

    def step(self, turn):
        return {"role": "tool"}


@pytest.mark.parametrize(
    ("environment", "reason", "error"),
    [
        (Raising, "environment_error", "the environment broke"),
        (Wrong, "environment_error", "step returned dict"),
        (Slow, "deadline", None),
        (Blocking, "deadline", None),
        (TimingOut, "environment_error", "TimeoutError: the simulator did not answer"),
    ],
)
def test_a_failing_or_slow_environment_ends_its_trajectory_only(environment, reason, error):
    renderer = renderer_for(CHAT_TEMPLATE)
    engine = ScriptedEngine(renderer.tokenizer, ["1"])
    start = time.monotonic()
    _, _, response = run(renderer, engine, environment, TurnLimits(4, 96, 240, 0.2))
    assert time.monotonic() - start < 0.9  # the blocking step still sleeps in its thread
    assert response.end_reason == reason
    assert (error is None and response.error is None) or error in response.error
    assert response.turns == 1 and response.token_ids  # the turn it took is kept


def test_a_failed_environment_scores_zero_whatever_the_verifier_says():
    failed = Response([1], "42", [0.0], end_reason="environment_error", error="boom")
    fine = Response([1], "42", [0.0], end_reason="answer")
    group = SampledGroup(Prompt("u", "", 42), [0], [failed, fine], 0)
    (scored,) = scored_groups([group], [Verdict(1.0, "right"), Verdict(1.0, "right")])
    assert scored.rewards == [0.0, 1.0]
    assert scored.verdicts[0].error == "environment"


@pytest.mark.parametrize(
    ("environment", "infra_failure"),
    [(Raising, "environment_error"), (Wrong, "environment_error"), (Slow, "environment_deadline")],
)
def test_an_environments_failure_is_not_the_models_and_is_never_scored(environment, infra_failure):
    """Its trajectory says so (the job masks it, groupflow/loop/infra_failures.py) and the
    reward side gives it the verdict error "environment" whatever its text would score."""
    renderer = renderer_for(CHAT_TEMPLATE)
    _, _, response = run(
        renderer,
        ScriptedEngine(renderer.tokenizer, ["1"]),
        environment,
        TurnLimits(4, 96, 240, 0.2),
    )
    assert response.infra_failure == infra_failure
    group = SampledGroup(Prompt("u", "", 1), [0], [response], 0)
    (scored,) = scored_groups([group], [Verdict(1.0, "right")])
    assert scored.verdicts[0].error == "environment" and scored.rewards == [0.0]


def test_a_turn_past_the_deadline_is_the_models_own():
    """The deadline checked after a slow turn (no environment waited on) is no failure."""
    renderer = renderer_for(CHAT_TEMPLATE)
    times = iter([0.0, 5.0])
    prompt = next(TASK.train_prompts(seed=1))
    engine = ScriptedEngine(renderer.tokenizer, ["1"])
    box = ToolBox([Calculator()], 5.0, 200)
    coro = run_trajectory(
        prompt,
        renderer.ids(prompt),
        engine,
        lambda p: ToolEnvironment(p, box, ToolCallParser("hermes", renderer.tokenizer, [])),
        ObservationRenderer(renderer),
        TurnLimits(4, 96, 240, 1.0),
        256,
        clock=lambda: next(times),
    )
    response = asyncio.run(coro)
    assert response.end_reason == "deadline" and response.infra_failure is None


class LostWorker:
    """A pool worker that is lost under every call, as Ray reports it."""

    class run:  # noqa: N801 - shaped as an actor's method
        @staticmethod
        async def remote(code, timeout_s):
            await asyncio.sleep(0.01)
            raise ray.exceptions.RayActorError()


def test_a_call_whose_tool_worker_is_lost_ends_its_trajectory_as_not_the_models():
    """The pool's client gives up before the tool's deadline, so the call is `lost`, not a
    `timeout` of the model's program, and the trajectory ends there, masked."""
    box = ToolBox([PythonTool(ToolPoolClient([LostWorker(), LostWorker()]).run, 1.0)], 1.0, 200)
    start = time.monotonic()
    reply = asyncio.run(box.call(ToolCall("python", {"code": "print(1)"})))
    assert reply.use.outcome == "lost" and "lost" in reply.content
    assert time.monotonic() - start < 1.0
    renderer = renderer_for(CHAT_TEMPLATE)
    parser = ToolCallParser("hermes", renderer.tokenizer, box.schemas)
    call = '<tool_call>{"name":"python","arguments":{"code":"print(1)"}}</tool_call>'
    _, _, response = run(
        renderer,
        ScriptedEngine(renderer.tokenizer, [call, "7"]),
        lambda p: ToolEnvironment(p, box, parser),
        TurnLimits(4, 128, 1000, 30.0),
        context=1024,
    )
    assert response.end_reason == "environment_error" and response.turns == 1
    assert response.infra_failure == "tool_worker_lost"


def test_a_user_environment_that_returns_messages_continues():
    class Echo:
        def __init__(self, prompt):
            self.n = 0

        def step(self, turn):
            self.n += 1
            return [{"role": "tool", "content": f"seen {self.n}"}] if self.n < 3 else None

    renderer = renderer_for(TAGGED)
    _, _, response = run(renderer, ScriptedEngine(renderer.tokenizer, ["a", "b", "c"]), Echo)
    assert (response.end_reason, response.turns) == ("answer", 3)
    assert "seen 1" in response.text and "seen 2" in response.text


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{{ raise_exception('no tools here') }}", "cannot render tool messages"),
        (
            "{%- for m in messages if m.role != 'tool' -%}{{ m.content }}{%- endfor -%}",
            "drops tool messages",
        ),
    ],
)
def test_a_template_that_cannot_render_tool_messages_is_refused_in_one_line(template, message):
    tokenizer = build_tokenizer(EXTRA, template)
    renderer = PromptRenderer(tokenizer, ChatSettings())
    with pytest.raises(PromptRenderError, match=message) as err:
        ObservationRenderer(renderer)
    assert "\n" not in str(err.value)


def test_no_template_no_multi_turn():
    renderer = PromptRenderer(build_tokenizer(), ChatSettings(chat_template="none"))
    with pytest.raises(PromptRenderError, match="needs a chat template"):
        ObservationRenderer(renderer)


# --- tools -----------------------------------------------------------------------------------


def test_the_calculator_computes_exactly():
    rng = random.Random()
    calc = Calculator()
    for _ in range(200):
        a, b, c = (rng.randint(-(10**12), 10**12) for _ in range(3))
        assert calc({"expression": f"{a}*{b}-({c})"}) == str(a * b - c)
    assert calc({"expression": "7/2"}) == "3.5"
    assert calc({"expression": "2**10 % 1000 // 3"}) == str(2**10 % 1000 // 3)


@pytest.mark.parametrize(
    ("expression", "shown"),
    [
        ("0.1+0.2", "0.3"),  # binary floats gave 0.30000000000000004
        ("0.1*3", "0.3"),
        ("1.1**2", "1.21"),
        ("2**-3", "0.125"),
        ("1e-5", "0.00001"),
        ("-1/8", "-0.125"),
        ("10/4", "2.5"),
        ("1/3", "0.33333333333333333333"),  # correctly rounded to 20 digits
        ("2/3", "0.66666666666666666667"),
        ("1e999-1e999", "0"),  # inf - inf was nan
        ("1e999*0", "0"),
        ("1e308*10", "1" + "0" * 309),  # was inf
        ("2**0.5*2**0.5", "2"),  # a fractional power: a float, to 15 digits
    ],
)
def test_the_calculator_answers_in_exact_decimals(expression, shown):
    assert Calculator()({"expression": expression}) == shown


def test_the_calculators_decimals_are_the_exact_values():
    rng = random.Random()
    calc = Calculator()

    def decimal() -> str:
        return f"{rng.randint(-(10**6), 10**6)}.{rng.randint(0, 10**6):06d}"

    for _ in range(200):
        a, b = decimal(), decimal()
        for op, exact in (("+", Fraction(a) + Fraction(b)), ("*", Fraction(a) * Fraction(b))):
            assert Fraction(calc({"expression": f"{a}{op}({b})"})) == exact
        if Fraction(b):
            quotient = Fraction(calc({"expression": f"{a}/({b})"}))
            # exact where the decimal ends, else within the 20 digits shown
            assert abs(quotient - Fraction(a) / Fraction(b)) <= abs(quotient) * Fraction(1, 10**19)


@pytest.mark.parametrize(
    "expression",
    [
        "1e999999999",  # checked before 10**999999999 is computed
        "1e-999999999",
        "1e300**1.5",
        "(-8)**(1/3)",
        "9**9**9",
        "10**5000",
        "1/0",
        "__import__('os').system('true')",
        "(1).__class__",
        "x+1",
        "(" * 500 + "1" + ")" * 500,
        "1" * 2000,
        "2.0**100000",
    ],
)
def test_the_calculator_refuses_what_it_does_not_bound(expression):
    with pytest.raises(ToolError):
        Calculator()({"expression": expression})


def test_the_tool_box_bounds_every_call():
    class Sleepy:
        name, description, parameters = "sleepy", "sleeps", {"type": "object"}

        async def __call__(self, arguments):
            await asyncio.sleep(5)

    class Broken:
        name, description, parameters = "broken", "raises", {"type": "object"}

        def __call__(self, arguments):
            raise KeyError("inside")

    class Loud:
        name, description, parameters = "loud", "prints a lot", {"type": "object"}

        def __call__(self, arguments):
            return "x" * 10_000

    box = ToolBox([Sleepy(), Broken(), Loud(), Calculator()], timeout_s=0.1, output_chars=50)

    def call(name, **arguments):
        return asyncio.run(box.call(ToolCall(name, arguments)))

    assert call("sleepy").use.outcome == "timeout"
    assert call("broken").use.outcome == "error" and "KeyError" in call("broken").content
    assert len(call("loud").content) < 70
    assert call("calculator", expression="6*7").content == "42"
    assert call("calculator", expression=[]).use.outcome == "error"
    assert call("nothing").use.outcome == "unknown"


def test_a_sync_tool_runs_off_the_event_loop_and_is_bounded_like_an_async_one():
    """A sync tool that blocks holds neither the loop (the engine's generation and the other
    trajectories) nor its caller past the timeout."""

    class Blocking:
        name, description, parameters = "blocking", "sleeps in a thread", {"type": "object"}

        def __call__(self, arguments):
            time.sleep(arguments["s"])
            return "woke"

    box = ToolBox([Blocking()], timeout_s=0.3, output_chars=50)

    async def call_while_ticking(seconds):
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        start = time.monotonic()
        reply = await box.call(ToolCall("blocking", {"s": seconds}))
        elapsed = time.monotonic() - start
        ticker.cancel()
        return reply, ticks, elapsed

    reply, ticks, elapsed = asyncio.run(call_while_ticking(0.15))
    assert reply.content == "woke" and reply.use.outcome == "ok"
    assert ticks >= 5, ticks  # the loop ran on while the tool slept (15 ticks' worth)
    reply, ticks, elapsed = asyncio.run(call_while_ticking(0.6))
    assert reply.use.outcome == "timeout" and elapsed < 0.55, (reply, elapsed)
    assert ticks >= 10, ticks


def test_the_python_tool_runs_from_the_process_where_there_is_no_tool_pool():
    """`groupflow eval` has no tool pool: the python tool's sandboxes start from its process."""
    box = ToolBox([PythonTool(in_process_run_code(allow_weak=True), 5.0)], 10.0, 200)

    def call(code):
        return asyncio.run(box.call(ToolCall("python", {"code": code})))

    a, b = random.randrange(10**6), random.randrange(10**6)
    assert call(f"print({a}*{b})").content.strip() == str(a * b)
    failed = call("import sys; sys.exit(3)")
    assert failed.use.outcome == "error" and "exit status 3" in failed.content


def test_a_call_whose_markers_are_special_tokens_is_still_read():
    """Hermes 2 Pro's <tool_call> is a special token: decoded as the parser asks (special
    tokens kept), the turn shows the call; decoded as vLLM does by default, it hides it."""
    tokenizer = build_tokenizer(EXTRA)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    parser = ToolCallParser("hermes", tokenizer, [])
    ids = tokenizer.encode(tool_call_text("12*34"), add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("<tool_call>") in ids
    kept = tokenizer.decode(ids, skip_special_tokens=parser.skip_special_tokens)
    assert [c.arguments for c in parser.parse(kept).calls] == [{"expression": "12*34"}]
    assert parser.parse(tokenizer.decode(ids, skip_special_tokens=True)).calls == []


def test_the_hermes_parser_reads_calls_and_names_the_broken_ones():
    parser = ToolCallParser("hermes", build_tokenizer(EXTRA), [])
    # Hermes 2 Pro marks <tool_call> special: turns are decoded with special tokens kept
    assert parser.skip_special_tokens is False
    two = tool_call_text("1*2") + tool_call_text("3*4")
    assert [c.arguments["expression"] for c in parser.parse(two).calls] == ["1*2", "3*4"]
    assert parser.parse("42").calls == [] and parser.parse("42").malformed is None
    assert parser.parse("<tool_call>{no</tool_call>").malformed
    assert parser.parse('<tool_call>{"name":"f","arguments":[1]}</tool_call>').malformed
    with pytest.raises(ValueError, match="agent.tool_parser"):
        ToolCallParser("no_such_parser", build_tokenizer(EXTRA), [])


@pytest.mark.parametrize("name", ["deepseek_v3", "jamba", "lfm2", "llama3_json", "mistral"])
def test_a_parser_that_raises_as_it_is_built_is_one_line_naming_the_setting(name):
    """These look for their model's call markers in the tokenizer as they are built: a
    traceback from `groupflow train` until issue 39; the driver builds the parser with the
    job's tokenizer when it vets the job (groupflow/run/job_prompts.py), before any actor."""
    with pytest.raises(ValueError) as err:
        ToolCallParser(name, build_tokenizer(EXTRA), [])
    message = str(err.value)
    assert message.startswith(f"agent.tool_parser: {name!r} cannot read this model's turns (")
    assert "RuntimeError: " in message and "\n" not in message


# --- what the driver makes of trajectories ------------------------------------------------------


def test_figures_sequences_and_sample_rows_of_trajectories():
    renderer = renderer_for(CHAT_TEMPLATE)
    prompt = next(TASK.train_prompts(seed=11))
    good = ScriptedEngine(renderer.tokenizer, [tool_call_text(prompt.uid), str(prompt.answer)])
    guess = ScriptedEngine(renderer.tokenizer, ["123"])
    responses = [run(renderer, e, prompt=prompt)[2] for e in (good, guess)]
    responses[1].tool_uses = [ToolUse("", "malformed"), ToolUse("python", "timeout", 2.0)]
    group = SampledGroup(prompt, renderer.ids(prompt), responses, 0)
    (scored,) = scored_groups([group], [Verdict(1.0, "ok"), Verdict(0.0, "no")])
    figures = agent_figures(responses)
    assert figures["tool_calls"] == {"calculator": 1, "(malformed)": 1, "python": 1}
    assert figures["tool_errors"] == {"(malformed)": 1}
    assert figures["tool_timeouts"] == {"python": 1}
    assert figures["tool_use_rate"] == 1.0 and figures["turns_mean"] == 1.5
    assert figures["end_reasons"] == {"answer": 2}
    observed = responses[0].loss_mask.count(0)
    total = sum(len(r.token_ids) for r in responses)
    assert figures["observation_token_share"] == pytest.approx(observed / total)
    cfg = build_config({"task": {"name": "tool_arithmetic"}})
    (first, _) = train_sequences([scored], group_advantages([scored], cfg), cfg.algorithm)
    assert first.loss_mask == responses[0].loss_mask
    assert first.num_model_tokens == len(first.vllm_logprobs)
    rows = sample_rows(1, [scored], [[0.5, -0.5]], renderer.tokenizer.decode)
    pieces = rows[0]["trajectory"]
    assert [next(iter(p)) for p in pieces] == ["model", "observation", "model"]
    assert "".join(next(iter(p.values())) for p in pieces) == renderer.tokenizer.decode(
        responses[0].token_ids
    )


def test_a_tool_task_brings_its_tools_and_settings_can_change_them():
    assert build_config({"task": {"name": "tool_arithmetic"}}).agent_tools() == ["calculator"]
    assert build_config({"task": {"name": "tool_arithmetic"}}).multi_turn
    assert not build_config({}).multi_turn
    cfg = build_config({"agent": {"tools": ["calculator", "python"]}})
    assert cfg.multi_turn and cfg.agent_tools() == ["calculator", "python"]
    assert not build_config(
        {"task": {"name": "tool_arithmetic"}, "agent": {"tools": []}}
    ).multi_turn


class RoutingEngine(ScriptedEngine):
    """A ScriptedEngine that returns routing as the engine does (rollout/routing_capture.py):
    a row per position it ran, all but the last sampled token's; each row names its request
    and position."""

    async def __call__(self, ids: list[int], max_tokens: int, turn: int) -> Response:
        response = await super().__call__(ids, max_tokens, turn)
        ran = len(ids) + len(response.token_ids) - 1
        rows = [[[len(self.requests) - 1, p % 256]] for p in range(ran)]
        response.routed_experts = np.array(rows, dtype=np.uint8)
        return response


def test_a_trajectorys_routing_is_each_tokens_from_the_first_request_that_ran_it():
    """The second turn's request runs the first turn's last token and the observation as its
    prompt: their routing is that request's; every earlier token's is the first request's."""
    renderer = renderer_for(CHAT_TEMPLATE)
    prompt = next(TASK.train_prompts(seed=random.randrange(10**6)))
    engine = RoutingEngine(renderer.tokenizer, [tool_call_text(prompt.uid), str(prompt.answer)])
    _, prompt_ids, response = run(renderer, engine, prompt=prompt)
    assert response.turns == 2
    routing = response.routed_experts
    assert len(routing) == len(prompt_ids) + len(response.token_ids) - 1
    first_ran = len(prompt_ids) + len(engine.generated[0]) - 1
    assert (routing[:first_ran, 0, 0] == 0).all() and (routing[first_ran:, 0, 0] == 1).all()
    assert (routing[:, 0, 1] == np.arange(len(routing)) % 256).all()
