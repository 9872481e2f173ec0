"""Prompt rendering: chat templates, system prompts, message lists and raw text."""

import random

import pytest

from groupflow.quickstart import CHARACTERS, build_tokenizer
from groupflow.records import Prompt
from groupflow.rollout.prompt_render import ChatSettings, PromptRenderer, PromptRenderError

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
    assert not renderer.uses_chat
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
    assert not renderer.uses_chat
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
