"""An engine's OpenAI-compatible endpoint for harnesses (`agent.harness`, docs/agents.md):
/v1/chat/completions, /v1/completions and /v1/models under /trajectories/<id>/v1, served on
127.0.0.1 from the engine's own event loop.

Each trajectory has an unguessable id, opened when its harness starts and closed when it ends:
a call naming any other id (another trajectory's that ended, another job's, a guess) is a 404,
and a call without the engine's key a 401. The requests and responses are vLLM's own OpenAI
protocol models, and a call becomes one request of the engine (`ServeCall`), so a trajectory
stays on the engine that serves it and reuses its prefix cache. Every call is recorded token
in and token out (rollout/harness_record.py): a conversation that extends the trajectory's last
one is rendered for its new messages only, appended to the ids the engine already has.

A call the endpoint refuses never reaches the engine, and is counted by reason
(`Endpoint.refused`): malformed (the body is no request, a message the template cannot
render), over_calls (past `agent.max_turns` calls of one trajectory: a flood stops there),
too_long (no room left in the context), unknown (the id names no open trajectory),
unauthorized (a wrong key) and unsupported (a setting the endpoint does not serve).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from groupflow.core.records import Response
from groupflow.rollout.harness_record import Continuation, HarnessRecord, message_key
from groupflow.rollout.observations import ObservationRenderer
from groupflow.rollout.prompt_render import PromptRenderer, PromptRenderError
from groupflow.rollout.toolbox import ToolCallParser

if TYPE_CHECKING:
    from vllm import SamplingParams

# One engine request on `ids`: a response per choice, its text less the end-of-text token.
ServeCall = Callable[[list[int], "SamplingParams"], Awaitable[list[Response]]]

# Prompts are rendered here, off the engine's event loop (one thread: the tokenizer is entered
# by one rendering at a time).
_RENDERING = ThreadPoolExecutor(max_workers=1, thread_name_prefix="endpoint-render")
_RENDERERS_KEPT = 16  # renderers of distinct tool declarations kept per endpoint
_BACKLOG = 4096  # connections waiting to be accepted


class Refused(Exception):
    """A call the endpoint answers with an error, never sending it to the engine."""

    def __init__(self, status: int, reason: str, message: str):
        super().__init__(message)
        self.status, self.reason = status, reason


@dataclass(frozen=True)
class EndpointLimits:
    max_calls: int  # per trajectory (agent.max_turns)
    turn_tokens: int  # a call's response limit (rollout.sampling.max_tokens, the task's own)
    max_model_len: int
    # the job's sampling settings (temperature, top_p, top_k, min_p), where a call sets none
    defaults: dict = field(default_factory=dict)


@dataclass
class Session:
    """One open trajectory's calls."""

    id: str
    record: HarnessRecord = field(default_factory=HarnessRecord)
    taken: int = 0  # calls admitted, sampled or still sampling
    limits: EndpointLimits | None = None


class Endpoint:
    def __init__(
        self,
        serve: ServeCall,
        renderer_for: Callable[[list[dict] | None], PromptRenderer],
        parser: ToolCallParser,
        model: str,
    ):
        """renderer_for(tools): the job's chat template declaring `tools` (no system prompt:
        the harness writes its own)."""
        self.serve = serve
        self.renderer_for = renderer_for
        self.parser = parser
        self.model = model
        self.key = secrets.token_urlsafe(24)
        self.refused: Counter[str] = Counter()
        self.sessions: dict[str, Session] = {}
        self._renderers: dict[str, tuple[PromptRenderer, ObservationRenderer]] = {}
        self._server = None
        self._serving: asyncio.Task | None = None
        self.port = 0

    async def start(self) -> None:
        """Serve on 127.0.0.1, a port of the system's choice, from the running event loop."""
        import uvicorn

        await asyncio.to_thread(_first_imports)  # in a thread: not on the loop's first calls
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        # a harness may open many connections at once (a flood): queued, not refused
        sock.listen(_BACKLOG)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app(), log_level="warning", access_log=False, lifespan="off")

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                yield  # the engine's process keeps its own handlers (Ray's, the job's stop)

        self._server = Server(config)
        self._serving = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._serving.done():
                self._serving.result()  # what stopped it
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            await self._serving

    def open(self, limits: EndpointLimits) -> Session:
        session = Session(secrets.token_urlsafe(24), limits=limits)
        self.sessions[session.id] = session
        return session

    def close(self, session: Session) -> None:
        self.sessions.pop(session.id, None)

    def base_url(self, session: Session) -> str:
        return f"http://127.0.0.1:{self.port}/trajectories/{session.id}/v1"

    def app(self):
        """The routes, on Starlette (what vLLM's FastAPI server stands on)."""
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        def route(path: str, handle, method: str) -> Route:
            async def answered(request) -> JSONResponse:
                try:
                    session = self._session(request, request.path_params["trajectory"])
                    return JSONResponse(await handle(session, request))
                except Refused as err:
                    self.refused[err.reason] += 1
                    error = {"message": str(err), "type": err.reason, "param": None}
                    return JSONResponse({"error": {**error, "code": err.status}}, err.status)

            return Route(f"/trajectories/{{trajectory}}/v1/{path}", answered, methods=[method])

        return Starlette(
            routes=[
                route("chat/completions", self._chat, "POST"),
                route("completions", self._completions, "POST"),
                route("models", self._models, "GET"),
            ]
        )

    def _session(self, request, trajectory: str) -> Session:
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {self.key}".encode()):
            raise Refused(401, "unauthorized", "the key is not this endpoint's")
        session = self.sessions.get(trajectory)
        if session is None:
            raise Refused(404, "unknown", "no open trajectory has this id")
        return session

    async def _models(self, session: Session, request) -> dict:
        from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList

        card = ModelCard(id=self.model, owned_by="groupflow", max_model_len=None)
        return ModelList(data=[card]).model_dump()

    async def _body(self, request, protocol):
        """The request body as vLLM's protocol model; Refused (400) naming what is wrong."""
        from pydantic import ValidationError

        try:
            body = await request.json()
        except ValueError:
            raise Refused(400, "malformed", "the body is not JSON") from None
        if not isinstance(body, dict):
            raise Refused(400, "malformed", "the body is not a JSON object")
        try:
            parsed = protocol.model_validate(body)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise Refused(400, "malformed", f"{where}: {first['msg']}") from None
        if parsed.stream:
            raise Refused(400, "unsupported", "stream is not served: ask without it")
        return body, parsed

    def _admit(self, session: Session) -> None:
        """Take one of the trajectory's calls; Refused (429) past them. Checked once before
        the body is read (a flood's calls cost no parsing) and once when the call is sent."""
        self._check_calls(session)
        session.taken += 1

    def _check_calls(self, session: Session) -> None:
        if session.taken >= session.limits.max_calls:
            raise Refused(
                429,
                "over_calls",
                f"this trajectory has made its {session.limits.max_calls} calls (agent.max_turns)",
            )

    def _params(self, body: dict, parsed, prompt: list[int], session: Session, logprobs):
        limits = session.limits
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        if asked is not None and (not isinstance(asked, int) or asked < 1):
            raise Refused(400, "malformed", "max_tokens: a positive integer")
        room = limits.max_model_len - len(prompt)
        if room <= 0:
            raise Refused(
                400,
                "too_long",
                f"the prompt is {len(prompt)} tokens; the context is {limits.max_model_len}",
            )
        max_tokens = min(asked or limits.turn_tokens, limits.turn_tokens, room)
        params = parsed.to_sampling_params(max_tokens, limits.defaults)
        # the sampled token's log-prob is recorded always (the off-policy correction's)
        params.logprobs = max(logprobs or 0, 0)
        return params

    def _renderers_for(
        self, tools: list[dict] | None
    ) -> tuple[PromptRenderer, ObservationRenderer]:
        key = json.dumps(tools, sort_keys=True)
        if key not in self._renderers:
            if len(self._renderers) >= _RENDERERS_KEPT:
                self._renderers.pop(next(iter(self._renderers)))
            renderer = self.renderer_for(tools)
            self._renderers[key] = (renderer, ObservationRenderer(renderer))
        return self._renderers[key]

    async def _chat(self, session: Session, request) -> dict:
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionLogProbs,
            ChatCompletionLogProbsContent,
            ChatCompletionRequest,
            ChatCompletionResponse,
            ChatCompletionResponseChoice,
            ChatMessage,
        )
        from vllm.entrypoints.serve.engine.protocol import UsageInfo

        self._check_calls(session)
        body, parsed = await self._body(request, ChatCompletionRequest)
        if parsed.tool_choice not in (None, "auto", "none"):
            raise Refused(400, "unsupported", "tool_choice: 'auto' and 'none' are served")
        self._admit(session)
        messages = [plain_message(m) for m in body["messages"]]
        tools = body.get("tools") or None
        tools_key = json.dumps(tools, sort_keys=True)
        record = session.record
        continued = record.chat_continuation(messages, tools_key)
        loop = asyncio.get_running_loop()
        try:
            renderer, observations = await loop.run_in_executor(
                _RENDERING, self._renderers_for, tools
            )
            if continued is not None:
                observed, _ = await loop.run_in_executor(
                    _RENDERING,
                    observations.ids,
                    continued.new_messages,
                    continued.last_token(record),
                )
                prompt = record.segments[continued.segment].full[: continued.length] + observed
            else:
                prompt = await loop.run_in_executor(_RENDERING, _rendered_ids, renderer, messages)
        except PromptRenderError as err:
            raise Refused(400, "malformed", f"messages: {err}") from None
        params = self._params(body, parsed, prompt, session, parsed.top_logprobs)
        # some models' call markers are special tokens: decoded as the parser asks
        params.skip_special_tokens = self.parser.skip_special_tokens
        sampled = await self.serve(prompt, params)
        keys = tuple(message_key(m) for m in messages)
        choices, served = [], []
        for j, response in enumerate(sampled):
            content, calls = response.text, []
            if tools and parsed.tool_choice != "none":
                found = self.parser.extract(response.text)
                if found.tools_called:
                    content, calls = found.content or None, found.tool_calls
            message = ChatMessage(role="assistant", content=content, tool_calls=calls)
            served.append(keys + (message_key(message.model_dump()),))
            logprobs = None
            if parsed.logprobs:
                tokens = renderer.tokenizer.convert_ids_to_tokens(response.token_ids)
                logprobs = ChatCompletionLogProbs(
                    content=[
                        ChatCompletionLogProbsContent(token=t, logprob=lp)
                        for t, lp in zip(tokens, response.logprobs, strict=True)
                    ]
                )
            choices.append(
                ChatCompletionResponseChoice(
                    index=j,
                    message=message,
                    logprobs=logprobs,
                    finish_reason="tool_calls" if calls else response.finish_reason,
                    token_ids=response.token_ids if parsed.return_token_ids else None,
                )
            )
        record.add_call(prompt, continued, sampled, served, tools_key)
        answer = ChatCompletionResponse(
            model=parsed.model or self.model,
            choices=choices,
            usage=_usage(UsageInfo, prompt, sampled),
            prompt_token_ids=prompt if parsed.return_token_ids else None,
        )
        return answer.model_dump(exclude_none=True)

    async def _completions(self, session: Session, request) -> dict:
        from vllm.entrypoints.openai.completion.protocol import (
            CompletionLogProbs,
            CompletionRequest,
            CompletionResponse,
            CompletionResponseChoice,
        )
        from vllm.entrypoints.serve.engine.protocol import UsageInfo

        self._check_calls(session)
        body, parsed = await self._body(request, CompletionRequest)
        given = body.get("prompt")
        if isinstance(given, list) and len(given) == 1 and not isinstance(given[0], int):
            given = given[0]  # a batch of one prompt
        if isinstance(given, str):
            renderer, _ = self._renderers_for(None)
            prompt = await asyncio.get_running_loop().run_in_executor(
                _RENDERING, renderer.content_tokens.text_ids, given
            )
        elif isinstance(given, list) and given and all(isinstance(t, int) for t in given):
            vocabulary = len(self.parser.tokenizer)
            if not all(0 <= t < vocabulary for t in given):
                raise Refused(400, "malformed", f"prompt: token ids are 0 to {vocabulary - 1}")
            prompt = list(given)
        else:
            raise Refused(400, "unsupported", "prompt: one text or one list of token ids")
        self._admit(session)
        continued: Continuation | None = session.record.ids_continuation(prompt)
        params = self._params(body, parsed, prompt, session, parsed.logprobs)
        sampled = await self.serve(prompt, params)
        session.record.add_call(prompt, continued, sampled)
        choices = []
        for j, response in enumerate(sampled):
            logprobs = None
            if parsed.logprobs is not None:
                tokens = self.parser.tokenizer.convert_ids_to_tokens(response.token_ids)
                logprobs = CompletionLogProbs(tokens=tokens, token_logprobs=response.logprobs)
            choices.append(
                CompletionResponseChoice(
                    index=j,
                    text=response.text,
                    logprobs=logprobs,
                    finish_reason=response.finish_reason,
                    token_ids=response.token_ids if parsed.return_token_ids else None,
                    prompt_token_ids=prompt if parsed.return_token_ids else None,
                )
            )
        answer = CompletionResponse(
            model=parsed.model or self.model,
            choices=choices,
            usage=_usage(UsageInfo, prompt, sampled),
        )
        return answer.model_dump(exclude_none=True)


def _first_imports() -> None:
    """What the first calls would import, on the engine's loop: vLLM's protocol models, and
    the openai SDK's resources a harness's client loads on its first use."""
    import vllm.entrypoints.openai.chat_completion.protocol  # noqa: F401
    import vllm.entrypoints.openai.completion.protocol  # noqa: F401
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url="http://127.0.0.1:1/v1", api_key="-")
    client.chat.completions, client.completions, client.models  # noqa: B018


def plain_message(message: dict) -> dict:
    """A request's message as a chat template reads it: a content of text parts joined, a
    tool call's arguments as an object (as vLLM's server hands them to templates)."""
    plain = {k: v for k, v in message.items() if v is not None}
    content = plain.get("content")
    if isinstance(content, list):
        plain["content"] = "".join(
            part.get("text", "") for part in content if isinstance(part, dict)
        )
    calls = []
    for call in plain.get("tool_calls") or ():
        function = dict(call.get("function") or {})
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments)
            except ValueError:
                pass  # the template shows it as it is
        calls.append({**call, "function": function})
    if calls:
        plain["tool_calls"] = calls
    return plain


def _rendered_ids(renderer: PromptRenderer, messages: list[dict]) -> list[int]:
    pieces = renderer.render_pieces(messages, "cannot render the harness's messages")
    return renderer.content_tokens.ids(pieces)


def _usage(usage, prompt: list[int], sampled: list[Response]):
    completion = sum(len(r.token_ids) for r in sampled)
    return usage(
        prompt_tokens=len(prompt),
        completion_tokens=completion,
        total_tokens=len(prompt) + completion,
    )
