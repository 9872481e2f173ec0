"""Prompts -> the token ids the policy sees, through the tokenizer's chat template when it has
one (`task.chat_template`, `task.system_prompt`).

The engine renders every prompt once and hands the ids on with its samples, so the learner
trains on exactly the ids vLLM generated from: no second rendering can drift from the first.

A message's content is data, never markup: a dataset prompt that says `<eos>` is the text
`<eos>`, not the end-of-text token. The template is rendered with a stand-in for each content
(`render_pieces`), which cuts the rendering into the template's own text and each content as
the template wrote it (trimmed, escaped, whatever it does to it), and rollout/content_tokens.py
tokenises the contents without their special tokens.

A chat template is code from a model directory. Jinja's sandbox stops attribute escapes, but
not a template that loops without end, recurses until the interpreter dies or builds a huge
string. So the driver vets the template before any actor starts (`vetted_lengths`): a forked
child renders every prompt the job can draw (no made-up conversation, which a strict template
may rightly refuse), under a memory limit, and is killed when one prompt takes over STALL_S; a template that fails, stalls,
crashes or writes more than MAX_RENDERED_CHARS is refused in one line naming it. The engines
then render in-process at full speed: the prompts they get are the ones vetted. Vetting in a
child, not bounding every render, is what bounds CPU time at no cost per training prompt: a
Python thread cannot be stopped, and an alarm signal reaches only a main thread.
"""

from __future__ import annotations

import logging
import multiprocessing
import resource
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from groupflow.core.records import Prompt
from groupflow.rollout.content_tokens import ContentTokens, Piece

STALL_S = 5.0  # the longest one prompt may take to render (and tokenize) when vetted
MAX_RENDERED_CHARS = 1_000_000  # far past any prompt that fits an engine
VET_MEMORY_BYTES = 2 << 30  # what a vetting child may allocate beyond the driver's size
PROGRESS_EVERY_S = 0.2  # how often a vetting child reports the lengths measured so far
LOG_EVERY_S = 10.0  # how often a long vetting (a large dataset) says how far it has got

log = logging.getLogger(__name__)


class PromptRenderError(ValueError):
    """A prompt or setting the tokenizer cannot render, reported as one line."""


@dataclass
class ChatSettings:
    chat_template: str = "auto"  # "auto" | "none" | a path to a Jinja template file
    system_prompt: str | None = None
    tools: list[dict] | None = None  # declarations of a multi-turn job's tools (rollout/toolbox.py)


class PromptRenderer:
    """Renders a Prompt to ids: chat messages through the template, or its raw text."""

    def __init__(self, tokenizer, settings: ChatSettings):
        self.tokenizer = tokenizer
        self.system_prompt = settings.system_prompt
        self.tools = settings.tools or None
        self.template = job_chat_template(tokenizer, settings.chat_template)
        self.template_name = _template_name(tokenizer, settings.chat_template)
        self.content_tokens = ContentTokens(tokenizer)
        # Stand-ins for contents: letters and digits, which no template filter changes, and
        # unknowable to whoever writes a content, so that none can hold one.
        self._stand_in = f"gf{secrets.token_hex(8)}m{{}}e"
        if self.template is None and settings.system_prompt is not None:
            raise PromptRenderError(
                "task.system_prompt: needs a chat template, and the tokenizer has none "
                "(set task.chat_template to a template file)"
            )

    def messages(self, prompt: Prompt) -> list[dict]:
        """The conversation a chat model sees: the system prompt, then the prompt's turns (a
        task's chat wording when it has one, else its text as one user turn)."""
        return self.messages_with_system(
            prompt.messages or [{"role": "user", "content": prompt.text}]
        )

    def messages_with_system(self, turns: list[dict]) -> list[dict]:
        if self.system_prompt is not None and turns[0].get("role") != "system":
            turns = [{"role": "system", "content": self.system_prompt}, *turns]
        return turns

    def ids(self, prompt: Prompt) -> list[int]:
        if self.template is None:
            if not prompt.text:
                raise PromptRenderError(
                    f"prompt {prompt.uid!r}: is only a list of messages, and the tokenizer has "
                    "no chat template (set task.chat_template)"
                )
            return self.content_tokens.text_ids(prompt.text)
        # The template writes any BOS itself; the tokenizer must not add a second one.
        return self.content_tokens.ids(self.prompt_pieces(prompt))

    def chat_text(self, prompt: Prompt) -> str:
        """The prompt through the chat template."""
        return "".join(p.text for p in self.prompt_pieces(prompt))

    def prompt_pieces(self, prompt: Prompt) -> list[Piece]:
        return self.render_pieces(self.messages(prompt), f"fails on prompt {prompt.uid!r}")

    def render_pieces(self, messages: list[dict], failure: str) -> list[Piece]:
        """`render`, cut into the template's own text and each message's content as the
        template wrote it. Found from stand-ins: one rendering with every content replaced by
        its stand-in, one with the real contents, and where the template did not write the
        contents as they are (it trimmed or escaped one), one more per content, with that
        content real. PromptRenderError where what the template writes around a content
        depends on the content."""
        stand_ins = {
            i: self._stand_in.format(i)
            for i, m in enumerate(messages)
            if isinstance(m.get("content"), str)
        }
        skeleton = self._split(self._with(messages, stand_ins, None, failure), stand_ins)
        contents = {i: messages[i]["content"] for i in stand_ins}
        verbatim = [
            Piece(contents[p.message], p.message) if p.message is not None else p for p in skeleton
        ]
        if "".join(p.text for p in verbatim) == self.render(messages, failure):
            return verbatim
        written = {
            i: self._written(self._with(messages, stand_ins, i, failure), skeleton, i, failure)
            for i in {p.message for p in skeleton if p.message is not None}
        }
        return [
            Piece(written[p.message], p.message) if p.message is not None else p for p in skeleton
        ]

    def _with(
        self, messages: list[dict], stand_ins: dict[int, str], real: int | None, failure: str
    ) -> str:
        """The rendering with every content but messages[real]'s replaced by its stand-in."""
        shown = [
            {**m, "content": stand_ins[i]} if i in stand_ins and i != real else m
            for i, m in enumerate(messages)
        ]
        return self.render(shown, failure)

    def _split(self, rendered: str, stand_ins: dict[int, str]) -> list[Piece]:
        by_text = {mark: i for i, mark in stand_ins.items()}
        pieces, at = [], 0
        while True:
            found = [(rendered.find(mark, at), mark) for mark in by_text]
            found = [(where, mark) for where, mark in found if where >= 0]
            if not found:
                break
            where, mark = min(found)
            if where > at:
                pieces.append(Piece(rendered[at:where]))
            pieces.append(Piece(mark, by_text[mark]))
            at = where + len(mark)
        if at < len(rendered):
            pieces.append(Piece(rendered[at:]))
        return pieces

    def _written(self, rendered: str, skeleton: list[Piece], message: int, failure: str) -> str:
        """What the template wrote for messages[message]'s content in `rendered` (that content
        real, every other a stand-in): the rendering less the skeleton's other pieces."""
        places = sum(p.message == message for p in skeleton)
        rest = sum(len(p.text) for p in skeleton if p.message != message)
        size, left = divmod(len(rendered) - rest, places)
        written = None
        if not left and size >= 0:
            start = 0
            for p in skeleton:
                if p.message == message:
                    written = rendered[start : start + size]
                    break
                start += len(p.text)
            rebuilt = "".join(written if p.message == message else p.text for p in skeleton)
            if rebuilt == rendered:
                return written
        raise PromptRenderError(
            f"{self.template_name}: {failure} (what it writes around a message depends on the "
            "message's content, which is kept apart from the template's own tokens)"
        )

    def render(self, messages: list[dict], failure: str) -> str:
        """Messages through the chat template, with a generation prompt and the job's tools;
        whatever the template raises is its fault, one line naming it and `failure`."""
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=self.tools,
                chat_template=self.template,
                add_generation_prompt=True,
                tokenize=False,
            )
        except Exception as err:  # a template is foreign code: it may raise anything
            raise PromptRenderError(f"{self.template_name}: {failure} ({_one_line(err)})") from None

    def vetted_lengths(self, prompts: Sequence[Prompt], stall_s: float = STALL_S) -> list[int]:
        """The token count of each prompt, rendered in a forked child (see the module's doc);
        PromptRenderError naming the template when it fails, stalls or runs away."""
        context = multiprocessing.get_context("fork")  # the child shares the loaded tokenizer
        receiver, sender = context.Pipe(duplex=False)
        child = context.Process(target=self._measure, args=(prompts, sender), daemon=True)
        child.start()
        sender.close()
        lengths: list[int] = []
        logged = time.monotonic()
        try:
            while True:
                if not receiver.poll(stall_s):
                    raise self._refused(f"a prompt took over {stall_s:g}s to render", lengths)
                try:
                    kind, value = receiver.recv()
                except EOFError:
                    child.join(1)
                    why = f"the renderer died (exit status {child.exitcode})"
                    raise self._refused(why, lengths) from None
                if kind == "refused":
                    raise PromptRenderError(value)
                lengths += value
                if kind == "done":
                    return lengths
                if time.monotonic() - logged > LOG_EVERY_S:
                    log.info("vetting prompts: %d of %d measured", len(lengths), len(prompts))
                    logged = time.monotonic()
        finally:
            child.kill()
            child.join()
            receiver.close()

    def _refused(self, why: str, lengths: list[int]) -> PromptRenderError:
        return PromptRenderError(
            f"{self.template_name}: refused: {why} ({len(lengths)} rendered before it)"
        )

    def _measure(self, prompts: Sequence[Prompt], sender) -> None:
        """The child: every prompt's token count, sent every PROGRESS_EVERY_S."""
        _limit_memory(VET_MEMORY_BYTES)
        try:
            lengths, sent = [], time.monotonic()
            for prompt in prompts:
                lengths.append(len(self._vetted_ids(prompt)))
                if time.monotonic() - sent > PROGRESS_EVERY_S:
                    sender.send(("lengths", lengths))
                    lengths, sent = [], time.monotonic()
            sender.send(("done", lengths))
        except PromptRenderError as err:
            sender.send(("refused", str(err)))
        except BaseException as err:  # MemoryError, RecursionError, ...: the template's doing
            sender.send(("refused", f"{self.template_name}: refused: {_one_line(err)}"))

    def _vetted_ids(self, prompt: Prompt) -> list[int]:
        if self.template is None:
            return self.ids(prompt)
        pieces = self.prompt_pieces(prompt)
        size = sum(len(p.text) for p in pieces)
        if size > MAX_RENDERED_CHARS:
            raise PromptRenderError(
                f"{self.template_name}: refused: renders prompt {prompt.uid!r} to {size} "
                f"characters (at most {MAX_RENDERED_CHARS})"
            )
        if size == 0:  # vLLM refuses it only once the engine runs, with a traceback
            raise PromptRenderError(
                f"{self.template_name}: refused: renders prompt {prompt.uid!r} to no text "
                "(an engine cannot sample from an empty prompt)"
            )
        return self.content_tokens.ids(pieces)


def check_prompt_lengths(
    prompts: Sequence[Prompt], lengths: Sequence[int], max_model_len: int, max_tokens: int
) -> None:
    """PromptRenderError naming the first prompt that does not fit (prompt_fits), if any."""
    overlong = too_long(prompts, lengths, max_model_len, max_tokens)
    if overlong:
        raise PromptRenderError(too_long_message(overlong, len(prompts), max_model_len, max_tokens))


def too_long(
    prompts: Sequence[Prompt], lengths: Sequence[int], max_model_len: int, max_tokens: int
) -> list[tuple[Prompt, int]]:
    """(prompt, its token count) of each prompt that does not fit (prompt_fits)."""
    return [
        (p, n)
        for p, n in zip(prompts, lengths, strict=True)
        if not prompt_fits(n, p.max_tokens or max_tokens, max_model_len)
    ]


def too_long_message(
    overlong: Sequence[tuple[Prompt, int]], total: int, max_model_len: int, max_tokens: int
) -> str:
    prompt, n = overlong[0]
    return (
        f"prompt {prompt.uid!r}: {n} tokens leave no room for {prompt.max_tokens or max_tokens} "
        f"response tokens in rollout.max_model_len={max_model_len} ({len(overlong)} of {total} "
        "prompts are too long)"
    )


def prompt_fits(prompt_tokens: int, max_tokens: int, max_model_len: int) -> bool:
    """A prompt an engine may take: its longest response still fits the context."""
    return prompt_tokens + max_tokens <= max_model_len


def _limit_memory(extra: int) -> None:
    """Cap the address space at its size now plus `extra`, so a runaway allocation fails
    with MemoryError instead of swapping the machine."""
    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (size + extra, size + extra))


def _one_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    text = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def _template_name(tokenizer, choice: str) -> str:
    if choice == "auto":
        return f"the chat template of {getattr(tokenizer, 'name_or_path', '') or 'the tokenizer'}"
    return f"task.chat_template {choice}"


def job_chat_template(tokenizer, choice: str) -> str | None:
    """The template a job renders with (`task.chat_template`): the tokenizer's own, none, or a
    file's text."""
    if choice == "none":
        return None
    if choice == "auto":
        return getattr(tokenizer, "chat_template", None) or None
    path = Path(choice)
    try:
        return path.read_text()
    except OSError as err:
        raise PromptRenderError(
            f"task.chat_template: cannot read {path} ({err.strerror})"
        ) from None
    except UnicodeDecodeError:
        raise PromptRenderError(f"task.chat_template: {path} is not UTF-8 text") from None
