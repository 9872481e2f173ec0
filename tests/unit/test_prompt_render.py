"""Prompt rendering: chat templates, system prompts, message lists and raw text."""

import json
import random

import pytest

from groupflow.core.records import Prompt
from groupflow.rollout.prompt_render import (
    ChatSettings,
    PromptRenderer,
    PromptRenderError,
    check_prompt_lengths,
)
from groupflow.run.quickstart import CHARACTERS, build_tokenizer

# A template in the quickstart tokenizer's alphabet: "S(...) U(...) A(" for a generation prompt.
TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] | upper }}({{ m['content'] }}) {% endfor %}"
    "{% if add_generation_prompt %}A({% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(CHARACTERS) for _ in range(n)).strip() or "x"


def test_raw_text_is_encoded_as_before(tokenizer):
    renderer = PromptRenderer(tokenizer, ChatSettings("none"))
    text = _text(random.Random(), 20)
    assert renderer.template is None
    assert renderer.ids(Prompt("p", text, None)) == tokenizer.encode(text)


def test_template_file_renders_system_and_user_turns(tokenizer, tmp_path):
    rng = random.Random()
    user, system = _text(rng, 12), _text(rng, 8)
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    renderer = PromptRenderer(tokenizer, ChatSettings(str(path), system))
    ids = renderer.ids(Prompt("p", user, None))
    assert tokenizer.decode(ids) == f"S({system}) U({user}) A("
    assert ids == tokenizer.encode(f"S({system}) U({user}) A(", add_special_tokens=False)


def test_auto_uses_the_tokenizers_own_template_and_message_lists(tokenizer):
    tokenizer.chat_template = TEMPLATE
    try:
        renderer = PromptRenderer(tokenizer, ChatSettings("auto"))
        turns = [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "2+2"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "3+3"},
        ]
        ids = renderer.ids(Prompt("p", "", None, messages=turns))
        assert tokenizer.decode(ids) == "S(be brief) U(2+2) A(4) U(3+3) A("
    finally:
        tokenizer.chat_template = None


def test_auto_without_a_template_is_raw_text(tokenizer):
    renderer = PromptRenderer(tokenizer, ChatSettings("auto"))
    assert renderer.template is None
    assert renderer.ids(Prompt("p", "1+2=", None)) == tokenizer.encode("1+2=")


@pytest.mark.parametrize(
    "settings, prompt, culprit",
    [
        (ChatSettings("none", "be brief"), None, "task.system_prompt"),
        (ChatSettings("/nonexistent/chat.jinja"), None, "task.chat_template"),
        (ChatSettings("none"), Prompt("q7", "", None, [{"role": "user", "content": "1"}]), "q7"),
    ],
)
def test_what_cannot_be_rendered_is_named(tokenizer, settings, prompt, culprit):
    with pytest.raises(PromptRenderError, match=culprit) as err:
        PromptRenderer(tokenizer, settings).ids(prompt)
    assert "\n" not in str(err.value)


def test_a_tasks_chat_wording_is_used_only_with_a_template(tokenizer):
    from groupflow.reward_workers.tasks import make_task

    (prompt,) = make_task("arithmetic").eval_prompts(1)
    raw = PromptRenderer(tokenizer, ChatSettings("none"))
    assert raw.ids(prompt) == tokenizer.encode(prompt.text)  # the quickstart's format
    tokenizer.chat_template = TEMPLATE
    try:
        chat = PromptRenderer(tokenizer, ChatSettings("auto"))
        assert tokenizer.decode(chat.ids(prompt)).replace(" ", "") == (
            f"U({prompt.messages[0]['content']})A(".replace(" ", "")
        )
    finally:
        tokenizer.chat_template = None


# ----- hostile chat templates ------------------------------------------------------------------
LOOPS = "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}"
HOSTILE_TEMPLATES = {
    "attribute-escape": "{{ ''.__class__.__mro__ }}",
    "globals-escape": "{{ cycler.__init__.__globals__ }}",
    "mutating-the-messages": "{{ messages.append(1) }}{{ messages }}",
    "nested-loops": LOOPS,
    "three-nested-loops": "{% for i in range(1000) %}" * 3 + "{% endfor %}" * 3,
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "mutual-recursion": (
        "{% macro a(n) %}{{ b(n) }}{% endmacro %}{% macro b(n) %}{{ a(n) }}{% endmacro %}{{ a(1) }}"
    ),
    "huge-allocation": "{{ 'a' * 10**10 }}",
    "huge-output": "{% for i in range(3000) %}{{ 'x' * 1000 }}{% endfor %}",
    "raise": "{{ raise_exception('no thanks') }}",
    "undefined": "{{ nothing.at.all }}",
    "type-error": "{{ 1 + 'a' }}",
    "syntax-error": "{% for %}",
    "only-with-an-assistant-turn": (
        "{% for m in messages %}{% if m.role == 'assistant' %}{{ m.__class__.__mro__ }}{% endif %}"
        "{% endfor %}"
    ),
    "only-on-one-prompt": (
        "{% for m in messages %}{% if 'boom' in m.content %}" + LOOPS + "{% endif %}"
        "{{ m.content }}{% endfor %}"
    ),
}


@pytest.mark.parametrize("template", HOSTILE_TEMPLATES.values(), ids=HOSTILE_TEMPLATES)
def test_a_hostile_template_is_refused_quickly_in_one_line(tokenizer, tmp_path, template):
    import time

    path = tmp_path / "chat.jinja"
    path.write_text(template)
    renderer = PromptRenderer(tokenizer, ChatSettings(str(path)))
    conversation = [
        {"role": "user", "content": "1+1"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2+2"},
    ]
    prompts = [Prompt(f"p{i}", f"{i}+1", None) for i in range(50)]
    prompts += [Prompt("b", "boom", None), Prompt("c", "", None, messages=conversation)]
    started = time.monotonic()
    with pytest.raises(PromptRenderError, match=f"task.chat_template {path}") as err:
        renderer.vetted_lengths(prompts, stall_s=1.0)
    assert time.monotonic() - started < 5
    assert "\n" not in str(err.value)


QWEN_LIKE = (
    "{%- if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n"
    "{%- endif %}{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{{ message.content | trim }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@pytest.mark.parametrize("template", [TEMPLATE, QWEN_LIKE], ids=["conftest", "qwen-like"])
def test_a_normal_template_renders_as_transformers_does(tokenizer, tmp_path, template):
    path = tmp_path / "chat.jinja"
    path.write_text(template)
    renderer = PromptRenderer(tokenizer, ChatSettings(str(path), "be brief"))
    rng = random.Random()
    prompts = [Prompt(f"p{i}", _text(rng, 10), None) for i in range(20)]
    for prompt in prompts:
        text = tokenizer.apply_chat_template(
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": prompt.text}],
            chat_template=template,
            add_generation_prompt=True,
            tokenize=False,
        )
        assert renderer.ids(prompt) == tokenizer.encode(text, add_special_tokens=False)
    assert renderer.vetted_lengths(prompts) == [len(renderer.ids(p)) for p in prompts]


@pytest.mark.parametrize("content", [b"\xff\xfe{{ x }}", b"{{ 'a' }}\xc3"], ids=["bom", "cut"])
def test_a_template_file_that_is_not_text_is_named(tokenizer, tmp_path, content):
    path = tmp_path / "chat.jinja"
    path.write_bytes(content)
    with pytest.raises(PromptRenderError, match=f"task.chat_template: {path} is not UTF-8"):
        PromptRenderer(tokenizer, ChatSettings(str(path)))


def test_a_template_that_fails_in_the_engine_names_itself_and_the_prompt(tokenizer, tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text("{% if messages|length > 1 %}{{ raise_exception('two') }}{% endif %}x")
    renderer = PromptRenderer(tokenizer, ChatSettings(str(path)))
    renderer.ids(Prompt("ok", "1", None))
    turns = [{"role": "user", "content": "1"}, {"role": "user", "content": "2"}]
    with pytest.raises(PromptRenderError, match=f"{path}: fails on prompt 'q9'.*two"):
        renderer.ids(Prompt("q9", "", None, messages=turns))


# ----- prompts too long for the engines --------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer_dir(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(path)
    return str(path)


def dataset(path, lengths: list[int]):
    """Rows whose raw text is that many tokens (the quickstart tokenizer: one per character)."""
    rows = [{"prompt": f"{i:03d}" + "x" * (n - 3), "answer": "1"} for i, n in enumerate(lengths)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def job_config(task: dict | list, **sections):
    from groupflow.run.job_config import build_config

    raw = {"task": task, "rollout": {"max_model_len": 64, "sampling": {"max_tokens": 16}}}
    cfg = build_config(raw | sections)
    cfg.task.chat_template = "none"  # the raw text: one token a character
    return cfg


def check(cfg, tokenizer_dir) -> dict[str, int]:
    from groupflow.run.job_prompts import vet_prompts

    return vet_prompts(cfg, tokenizer_dir).left_out


def test_a_few_rows_too_long_are_left_out_and_logged(tmp_path, tokenizer_dir, caplog):
    from groupflow.reward_workers.tasks import make_task

    # 48 tokens + 16 for the response fit 64 exactly; 49 do not.
    path = dataset(tmp_path / "d.jsonl", [10] * 200 + [48, 49, 300])
    cfg = job_config({"name": "math", "options": {"dataset": path, "instruction": ""}})
    assert check(cfg, tokenizer_dir) == {"task": 2}
    assert cfg.task.options["skip_prompts"] == ["d.jsonl:202", "d.jsonl:203"]
    task = make_task("math", cfg.task.options)  # as every process of the job builds it
    uids = {p.uid for p in task.pool.train + task.pool.held_out}
    assert len(uids) == 201 and "d.jsonl:201" in uids
    (line,) = [r.getMessage() for r in caplog.records if "too long" in r.getMessage()]
    assert "'d.jsonl:202': 49 tokens" in line and "2 of 203 prompts" in line


@pytest.mark.parametrize(
    ("task", "culprit"),
    [
        (
            {"name": "math", "options": {"dataset": "LONG"}},
            r"task: prompt 'long.jsonl:5\d'.*\(5 of 55 prompts",
        ),
        ({"name": "arithmetic", "options": {"terms": 40}}, "task: prompt '7-1-0"),  # built in
        (
            {"name": "math", "options": {"dataset": "SHORT", "eval_dataset": "ONE_LONG"}},
            "task: no held-out prompts to evaluate on in .*short.jsonl and .*one_long.jsonl",
        ),
        (
            [{"name": "math", "max_tokens": 40, "options": {"dataset": "MID"}}],
            "task math: prompt 'mid.jsonl:1': 30 tokens leave no room for 40",
        ),
    ],
    ids=["many-rows", "built-in-task", "held-out-emptied", "mixture-max-tokens"],
)
def test_prompts_too_long_are_refused_in_one_line(tmp_path, tokenizer_dir, task, culprit):
    paths = {
        "LONG": dataset(tmp_path / "long.jsonl", [10] * 50 + [60] * 5),
        "SHORT": dataset(tmp_path / "short.jsonl", [10] * 200),
        "ONE_LONG": dataset(tmp_path / "one_long.jsonl", [60]),
        "MID": dataset(tmp_path / "mid.jsonl", [30] * 10),
    }
    for entry in task if isinstance(task, list) else [task]:
        options = entry["options"]
        options.update({k: paths[v] for k, v in options.items() if v in paths})
        if entry["name"] == "math":
            options["instruction"] = ""
    with pytest.raises(ValueError, match=culprit) as err:
        check(job_config(task), tokenizer_dir)
    assert "\n" not in str(err.value)


def test_the_prompts_left_out_are_counted_by_source(tmp_path, tokenizer_dir):
    """Each mixture entry and eval set reports how many of its rows it left out (the count
    the job exports as groupflow_prompts_left_out and writes to summary.json)."""
    rng = random.Random()
    names = ["a", "b", "hard"]
    overlong = {name: rng.randint(0, 2) for name in names}  # 1% of 200 rows at most
    paths = {}
    for name in names:
        lengths = [10] * 200 + [rng.randint(49, 90) for _ in range(overlong[name])]
        rng.shuffle(lengths)
        paths[name] = dataset(tmp_path / f"{name}.jsonl", lengths)
    options = {name: {"dataset": paths[name], "instruction": ""} for name in names}
    task = {
        "name": "mixture",
        "options": {
            "tasks": [
                {"name": "math", "label": name, "options": options[name]} for name in ("a", "b")
            ]
        },
        "eval_sets": [{"name": "hard", "task": "math", "options": options["hard"]}],
    }
    cfg = job_config(task)
    counts = check(cfg, tokenizer_dir)
    assert counts == {
        "task a": overlong["a"],
        "task b": overlong["b"],
        "task.eval_sets hard": overlong["hard"],
    }
    entries = [e["options"] for e in cfg.task.options["tasks"]] + [cfg.task.eval_sets[0].options]
    assert [len(o.get("skip_prompts", [])) for o in entries] == list(counts.values())


def test_an_eval_set_too_long_is_named(tmp_path, tokenizer_dir):
    path = dataset(tmp_path / "d.jsonl", [60] * 10)
    eval_sets = [{"name": "hard", "task": "math", "options": {"dataset": path, "instruction": ""}}]
    task = {"name": "arithmetic", "eval_sets": eval_sets}
    with pytest.raises(ValueError, match="task.eval_sets hard: prompt 'd.jsonl:"):
        check(job_config(task), tokenizer_dir)


@pytest.mark.parametrize(("tokens", "fits"), [(47, True), (48, True), (49, False)])
def test_the_engine_takes_no_prompt_that_leaves_no_room_for_a_response(tokens, fits):
    prompts = [Prompt("a", "", None), Prompt("z9", "", None, max_tokens=16)]
    if fits:
        check_prompt_lengths(prompts, [1, tokens], 64, 8)
    else:
        with pytest.raises(PromptRenderError, match="prompt 'z9': 49 tokens .* 16 response"):
            check_prompt_lengths(prompts, [1, tokens], 64, 8)


def test_a_long_vetting_says_how_far_it_has_got(tokenizer, monkeypatch, caplog):
    import groupflow.rollout.prompt_render as prompt_render

    monkeypatch.setattr(prompt_render, "PROGRESS_EVERY_S", 0.0)  # a report per prompt
    monkeypatch.setattr(prompt_render, "LOG_EVERY_S", 0.0)  # and a line per report
    rng = random.Random()
    prompts = [Prompt(f"p{i}", _text(rng, 10), None) for i in range(rng.randint(5, 30))]
    renderer = PromptRenderer(tokenizer, ChatSettings("none"))
    with caplog.at_level("INFO", logger=prompt_render.__name__):
        renderer.vetted_lengths(prompts)
    counts = [r.args[0] for r in caplog.records if "vetting prompts" in r.getMessage()]
    assert counts and counts == sorted(counts) and all(0 < c <= len(prompts) for c in counts)
    assert all(r.args[1] == len(prompts) for r in caplog.records if r.args)


def test_a_prompt_rendered_to_no_tokens_is_one_line_before_any_engine(tokenizer, tmp_path):
    """Round 3: vLLM's "The decoder prompt cannot be empty" came as a traceback from the
    engine; the vetting names the template and the row instead."""
    path = tmp_path / "empty.jinja"
    path.write_text("{% if false %}{{ messages }}{% endif %}")
    renderer = PromptRenderer(tokenizer, ChatSettings(str(path)))
    with pytest.raises(PromptRenderError) as err:
        renderer.vetted_lengths([Prompt("row-7", "1+1", None)])
    assert str(err.value) == (
        f"task.chat_template {path}: refused: renders prompt 'row-7' to no text (an engine "
        "cannot sample from an empty prompt)"
    )
