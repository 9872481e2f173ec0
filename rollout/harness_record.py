"""What a harness's trajectory trains on: every call it made through the endpoint
(rollout/endpoint.py), token in and token out, as one or more training sequences.

Each call records the exact ids the engine was given and sampled, vLLM's log-probs and the
policy version of each token. A call whose conversation extends an earlier call's (the same
messages, the assistant's reply as it was served, then new tool or user messages; or, for
/v1/completions, a prompt whose ids start with the earlier call's) continues that call's
sequence: the new messages are rendered once and appended as observation tokens (masked), and
the model's earlier ids are reused, never re-tokenised. Any other call (history rewritten:
reasoning dropped, a summary, an edit; a second choice of an n > 1 call; a branch from an
older call) starts a sequence of its own, on exactly the ids the engine was given. A
trajectory's sequences share its reward; how many it split into is counted
(`trajectory_splits` in the step record).

No Ray, no vLLM, no HTTP in here: the endpoint hands in ids and sampled responses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from groupflow.core.records import Response

# A conversation as compared between calls: each message reduced to what a template renders
# (role, text, tool calls with their arguments as JSON, the tool call it answers, a name).
MessageKey = tuple
ConversationKey = tuple[tuple[MessageKey, ...], str]  # (messages, the declared tools as JSON)


def message_key(message: dict) -> MessageKey:
    """What of a message a later call must repeat for its conversation to extend this one's:
    `None` and missing fields alike, arguments compared as JSON values."""
    calls = tuple(
        (
            call.get("function", {}).get("name"),
            json.dumps(_arguments(call.get("function", {}).get("arguments")), sort_keys=True),
        )
        for call in message.get("tool_calls") or ()
    )
    return (
        message.get("role"),
        message.get("content") or "",
        calls,
        message.get("tool_call_id") or "",
        message.get("name") or "",
    )


def _arguments(arguments):
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


@dataclass
class Segment:
    """One training sequence: the ids its first call was given, then every model token
    (mask 1) and every observation token (mask 0) after them."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[tuple[int, int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    calls: int = 0
    finish_reason: str = "stop"

    @property
    def full(self) -> list[int]:
        return self.prompt_ids + self.ids

    def add_observation(self, ids: list[int]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)

    def add_sampled(self, sampled: Response) -> None:
        for version, start in sampled.versions:
            if not self.versions or self.versions[-1][0] != version:
                self.versions.append((version, len(self.ids) + start))
        self.ids += sampled.token_ids
        self.mask += [1] * len(sampled.token_ids)
        self.logprobs += sampled.logprobs
        self.texts.append(sampled.text)
        self.finish_reason = sampled.finish_reason
        self.calls += 1

    def response(self) -> Response:
        return Response(
            token_ids=self.ids,
            text="".join(self.texts),
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            versions=self.versions,
            loss_mask=self.mask,
            turns=self.calls,
            prompt_ids=self.prompt_ids,
        )


@dataclass(frozen=True)
class Continuation:
    """Where a call's prompt continues a recorded call: the segment, how many of its ids
    (prompt and response) the call extends, and for a chat call the messages after the
    recorded conversation (rendered as the observation)."""

    segment: int
    length: int
    new_messages: list[dict] = field(default_factory=list)

    def last_token(self, record: HarnessRecord) -> int | None:
        ids = record.segments[self.segment].full
        return ids[self.length - 1] if self.length else None


class HarnessRecord:
    """Every call of one trajectory, as segments (training sequences)."""

    def __init__(self):
        self.segments: list[Segment] = []
        self.calls = 0
        # a served conversation (ending in the assistant's reply as served) -> where it is
        self._conversations: dict[ConversationKey, tuple[int, int]] = {}
        self._latest = -1  # the segment of the latest call

    def chat_continuation(self, messages: list[dict], tools: str) -> Continuation | None:
        """The longest served conversation `messages` starts with, followed by messages none
        of which is the assistant's; None: the call starts a sequence of its own."""
        keys = tuple(message_key(m) for m in messages)
        for k in range(len(keys) - 1, 0, -1):
            found = self._conversations.get((keys[:k], tools))
            if found is not None:
                tail = messages[k:]
                if any(m.get("role") == "assistant" for m in tail):
                    return None
                return Continuation(found[0], found[1], tail)
        return None

    def ids_continuation(self, prompt: list[int]) -> Continuation | None:
        """The latest segment whose ids `prompt` starts with (a /v1/completions call)."""
        for index in sorted(range(len(self.segments)), key=lambda i: i != self._latest):
            full = self.segments[index].full
            if prompt[: len(full)] == full:
                return Continuation(index, len(full))
        return None

    def add_call(
        self,
        prompt: list[int],
        continued: Continuation | None,
        sampled: list[Response],
        served: list[tuple[MessageKey, ...]] | None = None,
        tools: str = "",
    ) -> None:
        """Record a call given `prompt` that sampled `sampled` (one per choice). `served`: for a
        chat call, each choice's conversation as the harness will send it back (its messages
        and the assistant's reply as served)."""
        self.calls += 1
        placed: list[int] = []
        for j, response in enumerate(sampled):
            index = None
            if j == 0 and continued is not None:
                segment = self.segments[continued.segment]
                if len(segment.full) == continued.length and prompt[: continued.length] == (
                    segment.full
                ):
                    segment.add_observation(prompt[continued.length :])
                    index = continued.segment
            if index is None:
                self.segments.append(Segment(list(prompt)))
                index = len(self.segments) - 1
            self.segments[index].add_sampled(response)
            placed.append(index)
        self._latest = placed[0]
        for index, conversation in zip(placed, served or (), strict=False):
            self._conversations[(conversation, tools)] = (index, len(self.segments[index].full))

    def responses(self) -> list[Response]:
        """The segments as responses, the latest call's last (it holds the final answer)."""
        order = [i for i in range(len(self.segments)) if i != self._latest] + [self._latest]
        return [self.segments[i].response() for i in order if i >= 0]
