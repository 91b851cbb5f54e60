"""The Starlette application: /v1/completions, /v1/chat/completions, /v1/models (and /v1/models/{id}), /health,
/metrics, /openapi.json."""

from __future__ import annotations

import inspect
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request as HttpRequest
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from jitney.core import chat as chats
from jitney.core.engine import Engine
from jitney.core.grammar import UNFOLLOWABLE
from jitney.core.request import Completion, Request, RequestError
from jitney.core.stream import TokenStream, finished
from jitney.plugins.metrics import PrometheusMetrics
from jitney.serve import protocol as p
from jitney.serve.http import BearerAuth, json_response, read_body, unless_disconnected
from jitney.serve.openapi import openapi
from jitney.serve.protocol import ApiError, parse, sampling

log = logging.getLogger("jitney.serve")

PUBLIC_PATHS = ("/health", "/openapi.json")


def build_app(
    engine: Engine, model_name: str, metrics: PrometheusMetrics, api_key: str | None = None, max_waiting: int = 256,
    max_body_bytes: int = 1 << 20, max_n: int = 16, max_tokens: int | None = None,
) -> Starlette:
    """An app serving `engine` under `model_name`; the engine runs for the app's lifetime.

    `max_waiting`: samples (a request counts its `n`) that may wait for the engine; beyond, 429 at once.
    `max_n`: the most samples one request may ask for. `max_tokens`: the most tokens one may ask for
    (default: only the model's context bounds it). All of them are stated in /openapi.json.
    """
    server = _Server(engine, model_name, metrics, max_waiting, max_body_bytes, max_n, max_tokens, bool(api_key))
    return Starlette(
        routes=[
            Route("/v1/completions", server.completions, methods=["POST"]),
            Route("/v1/chat/completions", server.chat, methods=["POST"]),
            Route("/v1/models", server.models),
            Route("/v1/models/{model_id:path}", server.model),
            Route("/health", server.health),
            Route("/metrics", server.prometheus),
            Route("/openapi.json", server.openapi_document),
        ],
        exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _internal_error},
        middleware=[Middleware(BearerAuth, api_key=api_key, public=PUBLIC_PATHS)],
        lifespan=server.lifespan,
    )


class _Server:
    """The endpoints over one engine, and what they share: limits, the request structs, the shutdown flag."""

    def __init__(self, engine: Engine, model_name: str, metrics: PrometheusMetrics, max_waiting: int,
                 max_body_bytes: int, max_n: int, max_tokens: int | None, secured: bool):
        self.engine, self.model_name, self.metrics = engine, model_name, metrics
        self.max_waiting, self.max_body_bytes, self.max_tokens = max_waiting, max_body_bytes, max_tokens
        self.CompletionBody, self.ChatBody = p.request_bodies(model_name, max_n, engine.vocab_size, max_tokens)
        self.schema = msgspec.json.encode(openapi(self.CompletionBody, self.ChatBody, secured, _version()))
        self.prompt_bytes = _most_prompt_bytes(engine)
        self.admitting = 0  # samples accepted but not yet queued in the engine (their prompts are tokenizing)
        # one tokenization at a time, off the event loop: it is CPU work beside the engine's own threads, and a
        # fast tokenizer whose calls overlap across threads can fail with "Already borrowed"
        self.tokenizing = anyio.CapacityLimiter(1)
        self.shutting_down = False
        self.pieces = TokenPieces(engine.tokenizer)

    @asynccontextmanager
    async def lifespan(self, app) -> AsyncIterator[None]:
        async with self.engine:
            try:
                yield
            finally:  # the engine's exit cancels what is still running: those requests are answered 503
                self.shutting_down = True

    # -- generation --------------------------------------------------------------------------------------

    async def completions(self, request: HttpRequest) -> Response:
        body = await self._admit(request, self.CompletionBody)
        with self._admitted(body.n):
            params = sampling(body, body.max_tokens, 16)
            if isinstance(body.prompt, str):
                self._check_size(len(body.prompt.encode()), "prompt")
                ids = await self._tokenize(self._encode, body.prompt)
            else:
                ids = body.prompt
            if body.echo and body.logprobs is not None:
                raise ApiError(400, "echo with logprobs would need the prompt's logprobs, which this server does not "
                                    "compute: send one of them", param="echo")
            echo = "" if not body.echo else body.prompt if isinstance(body.prompt, str) else self.engine.decode(ids)
            await self._compile(params)
            stream = await self._submit(ids, params, body)
        return await self._respond(request, body, stream, False, len(ids), echo)

    async def chat(self, request: HttpRequest) -> Response:
        body = await self._admit(request, self.ChatBody)
        with self._admitted(body.n):
            self._check_size(sum(len(m.role.encode()) + len(m.text().encode()) for m in body.messages), "messages")
            messages = [m.for_template() for m in body.messages]
            tools = body.offered_tools()
            ids = await self._tokenize(self._apply_template, (messages, tools))
            limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            room = min(1024, self.max_tokens or 1024, self.engine.max_context - len(ids))
            params = sampling(body, limit, max(1, room))
            if tools:  # a required or named call: the reply held to the calls' grammar
                choice = msgspec.to_builtins(body.tool_choice) if body.tool_choice is not None else "auto"
                try:
                    calls = chats.tool_grammar(tools, choice, parallel=body.parallel_tool_calls is not False)
                except ValueError as exc:
                    raise ApiError(400, str(exc), param="tool_choice") from None
                if calls is not None and params.grammar is not None:
                    raise ApiError(400, f"tool_choice {choice!r} and response_format both constrain the reply: "
                                        "send one", param="tool_choice")
                if calls is not None:
                    params = msgspec.structs.replace(params, grammar=calls)
            await self._compile(params)
            stream = await self._submit(ids, params, body)
        return await self._respond(request, body, stream, True, len(ids))

    async def _admit(self, request: HttpRequest, kind: type):
        """The parsed body, once the engine and the queue's room for its samples are checked."""
        body = parse(await read_body(request, self.max_body_bytes), kind, self.model_name)
        self._check_running()
        waiting = sum(1 + len(s.forks) for s in self.engine.waiting) + self.admitting  # samples, not requests
        if waiting + body.n > self.max_waiting:
            raise ApiError(429, f"the server is at capacity ({waiting} of {self.max_waiting} samples waiting); "
                                "retry later", kind="rate_limit_exceeded")
        return body

    @contextmanager
    def _admitted(self, n: int) -> Iterator[None]:
        """Counts `n` samples as waiting while their prompt is tokenized (they are not in the engine yet)."""
        self.admitting += n
        try:
            yield
        finally:
            self.admitting -= n

    def _check_running(self) -> None:
        if not self.engine.healthy:
            raise ApiError(503, "the engine is not running; retry later", kind="service_unavailable")

    def _check_size(self, size: int, param: str) -> None:
        # refused before tokenizing: no token covers more than the vocabulary's longest string
        if size > self.prompt_bytes:
            raise ApiError(400, f"the prompt ({size} bytes) is longer than the model's context of "
                                f"{self.engine.max_context} tokens can hold", param=param)

    async def _tokenize(self, fn, arg) -> list[int]:
        if self.engine.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
        return await anyio.to_thread.run_sync(fn, arg, limiter=self.tokenizing)

    async def _compile(self, params) -> None:
        """A request's grammar compiled (and cached) off the event loop before it is submitted: a bad one is a 400
        here rather than a failed request later."""
        grammars = getattr(self.engine, "grammars", None)  # (a fleet's gateway: each replica compiles its own)
        if params.grammar is None or grammars is None:
            return
        param = "response_format" if params.grammar.kind == "json" else "structured_outputs"
        try:
            await anyio.to_thread.run_sync(grammars.grammar, params.grammar, limiter=self.tokenizing)
        except (ValueError, RuntimeError) as exc:
            raise ApiError(400, str(exc), param=param) from None

    def _encode(self, text: str) -> list[int]:
        return list(self.engine.tokenizer.encode(text, add_special_tokens=True))

    def _apply_template(self, messages_and_tools: tuple[list[dict], list[dict] | None]) -> list[int]:
        try:
            return chats.prompt_ids(self.engine.tokenizer, *messages_and_tools)
        except Exception as exc:  # the template's own message (e.g. roles out of order)
            raise ApiError(400, f"cannot apply the chat template: {exc}", param="messages") from None

    async def _submit(self, ids: list[int], params, body) -> TokenStream:
        self._check_running()  # (again: tokenizing took a while)
        metadata = {**(body.metadata or {}), **({"user": body.user} if body.user is not None else {})} or None
        try:
            stream = self.engine.stream(Request(ids, params, request_id=f"cmpl-{uuid.uuid4().hex[:20]}",
                                                metadata=metadata))
            # (a fleet's gateway places the request on a replica first: `serve/cluster.RemoteEngine`)
            return await stream if inspect.isawaitable(stream) else stream
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None

    async def _respond(self, request: HttpRequest, body, stream: TokenStream, chat: bool, prompt_tokens: int,
                       echo: str = "") -> Response:
        """The answer, streamed or whole; `echo`: text before each completion's (the prompt's, when asked for)."""
        headers = getattr(stream, "headers", None)  # (a fleet's stream names the replica serving it)
        if body.stream:
            return StreamingResponse(self._events(body, stream, chat, prompt_tokens, echo), media_type="text/event-stream",
                                     headers=headers)
        present, done = await unless_disconnected(request, lambda: finished(stream))
        if not present:  # the client left and its request was aborted: nobody reads this
            return Response(status_code=499)
        failure = self._failure(done)
        if failure is not None:
            raise failure
        common = {"id": done.request_id, "created": int(time.time()), "model": self.model_name, "usage": _usage(done)}
        logprobs = self.pieces.chat_logprobs if chat else self.pieces.completion_logprobs
        if chat:
            choices = []
            for s in done.samples:
                content, calls = chats.parse_tool_calls(s.text) if _tools_on(body) else (s.text, [])
                choices.append(p.ChatChoice(
                    index=s.index, logprobs=logprobs(s.token_ids, s.logprobs),
                    message=p.AssistantMessage(role="assistant", content=content,
                                               tool_calls=[msgspec.convert(c, p.ToolCall) for c in calls] or None),
                    finish_reason="tool_calls" if calls else s.finish_reason))
            return json_response(p.ChatCompletion(object="chat.completion", **common, choices=choices), headers=headers)
        return json_response(p.Completion(object="text_completion", **common, choices=[
            p.CompletionChoice(index=s.index, text=echo + s.text, logprobs=logprobs(s.token_ids, s.logprobs),
                               finish_reason=s.finish_reason) for s in done.samples]), headers=headers)

    async def _events(self, body, stream: TokenStream, chat: bool, prompt_tokens: int, echo: str) -> AsyncIterator[bytes]:
        """Server-sent events: the chunks, then an error event if the request failed, then ``[DONE]``."""
        try:
            async for event in self._chunks(body, stream, chat, prompt_tokens, echo):
                yield event
        except Exception as exc:  # (a bug of ours: the client still learns the stream is broken)
            log.exception("streaming %s failed", stream.request_id)
            yield _sse(ApiError(500, f"internal error: {type(exc).__name__}", kind="server_error").body())
        yield b"data: [DONE]\n\n"

    async def _chunks(self, body, stream: TokenStream, chat: bool, prompt_tokens: int, echo: str) -> AsyncIterator[bytes]:
        head = {"id": stream.request_id, "created": int(time.time()), "model": self.model_name}
        envelope, piece = _chunk_types(chat, head)
        options = body.stream_options
        if options is not None and options.continuous_usage_stats:  # every chunk says the usage so far
            counted, generated = envelope, [0]

            def envelope(choices, usage=None):
                done = generated[0]
                return counted(choices, usage or p.Usage(prompt_tokens=prompt_tokens, completion_tokens=done,
                                                         total_tokens=prompt_tokens + done))
        else:
            generated = None
        unsent: dict[int, list] = {}  # sample -> its tokens not sent yet, with their logprobs (where asked for)
        calls = _HeldCalls() if chat and _tools_on(body) else None
        offsets: dict[int, int] = {}  # sample -> where the next token's text starts in its completion

        def logprobs(index: int):
            tokens = unsent.pop(index, None)
            if not tokens:
                return None
            ids, lps = [t.token_id for t in tokens], [(t.logprob, t.top_logprobs or {}) for t in tokens]
            if chat:
                return self.pieces.chat_logprobs(ids, lps)
            out = self.pieces.completion_logprobs(ids, lps, offsets.get(index, 0))
            offsets[index] = out.text_offset[-1] + len(out.tokens[-1])
            return out

        async with stream:
            for i in range(body.n if chat or echo else 0):
                yield _sse(envelope([piece(i, echo, role="assistant")]))  # (the role in chat, the echo otherwise)
            try:
                # the engine's token texts stop before any stop string: they add up to the sample's text
                async for token in stream:
                    if generated is not None:
                        generated[0] += 1
                    if token.logprob is not None:
                        unsent.setdefault(token.index, []).append(token)
                    text = token.text and (calls.add(token.index, token.text) if calls is not None else token.text)
                    if text:
                        yield _sse(envelope([piece(token.index, text, logprobs=logprobs(token.index))]))
            except RequestError:
                pass  # (the completion says why, below)
            done = stream.completion()
        failure = self._failure(done)
        if failure is not None:
            yield _sse(failure.body())
            return
        for s in done.samples:  # (with the logprobs of tokens that added no text, and the calls it made)
            content, found = calls.end(s.index) if calls is not None else (None, [])
            if content or found:
                yield _sse(envelope([p.ChatChunkChoice(index=s.index, delta=p.ChatDelta(content=content, tool_calls=[
                    p.ToolCallDelta(index=j, **msgspec.structs.asdict(msgspec.convert(c, p.ToolCall)))
                    for j, c in enumerate(found)] or None), logprobs=logprobs(s.index))]))
            yield _sse(envelope([piece(s.index, finish="tool_calls" if found else s.finish_reason,
                                       logprobs=logprobs(s.index))]))
        if body.stream_options is not None and body.stream_options.include_usage:
            yield _sse(envelope([], _usage(done)))

    def _failure(self, done: Completion) -> ApiError | None:
        """The error a request that did not finish answers: 500 when the engine failed it (400 when its grammar
        could not be followed), 503 when it was cancelled on the server's side (a client that left gets no
        answer)."""
        reasons = {s.finish_reason for s in done.samples}
        if "error" in reasons:
            if UNFOLLOWABLE in (done.error or ""):  # (the request's own grammar, not the server)
                return ApiError(400, f"generation failed: {done.error}")
            return ApiError(500, f"generation failed: {done.error}", kind="server_error")
        if reasons - {"stop", "length"}:
            why = "the server is shutting down" if self.shutting_down else "it was cancelled on the server"
            return ApiError(503, f"the request did not finish: {why}; retry later", kind="service_unavailable")
        return None

    # -- the rest --------------------------------------------------------------------------------------------

    def _card(self) -> p.ModelCard:
        return p.ModelCard(id=self.model_name, object="model", created=0, owned_by="jitney")

    async def models(self, request: HttpRequest) -> Response:
        return json_response(p.ModelList(object="list", data=[self._card()]))

    async def model(self, request: HttpRequest) -> Response:
        """`GET /v1/models/{id}` (the client's `models.retrieve`): the served model's card, or a 404."""
        asked = request.path_params["model_id"]
        if asked != self.model_name:
            err = ApiError(404, f"model {asked!r} does not exist; this server has {self.model_name!r}", param="model",
                           kind="model_not_found")
            return json_response(err.body(), 404)
        return json_response(self._card())

    async def health(self, request: HttpRequest) -> Response:
        if not self.engine.healthy:
            err = ApiError(503, "the engine's step loop is not running", kind="service_unavailable")
            return json_response(err.body(), 503)
        return json_response(p.Health(status="ok"))

    async def prometheus(self, request: HttpRequest) -> Response:
        text = self.metrics.render()
        if inspect.isawaitable(text):  # (a fleet's gateway gathers every replica's)
            text = await text
        return Response(text, media_type="text/plain; version=0.0.4")

    async def openapi_document(self, request: HttpRequest) -> Response:
        return Response(self.schema, media_type="application/json")


def _tools_on(body) -> bool:
    """Whether a chat body offers tools (its reply is then read for calls)."""
    return bool(getattr(body, "tools", None)) and getattr(body, "tool_choice", None) != "none"


class _HeldCalls:
    """A streamed reply that may be a tool call: each sample's text is held while it could still begin one, then
    streamed as text if it does not; a reply that begins with a call (a ``<tool_call>`` block, or JSON: a call
    object or a list of them, `chats.parse_tool_calls`) is held to the end and sent as its calls, or as text where
    it turns out to be none."""

    def __init__(self):
        self.held: dict[int, str] = {}
        self.calling: dict[int, bool] = {}  # sample -> True: a call, held to the end; False: text, streamed

    def add(self, index: int, text: str) -> str:
        """The text to stream now."""
        if self.calling.get(index) is False:
            return text
        held = self.held[index] = self.held.get(index, "") + text
        head = held.lstrip()
        if self.calling.get(index) or head.startswith(chats.OPEN) or head[:1] in ("{", "["):
            self.calling[index] = True
            return ""
        if chats.OPEN.startswith(head):
            return ""
        self.calling[index] = False
        return self.held.pop(index)

    def end(self, index: int) -> tuple[str | None, list[dict]]:
        """What a sample held at its end: text, and the calls it made."""
        held = self.held.pop(index, "")
        if not self.calling.get(index):
            return held or None, []
        return chats.parse_tool_calls(held)


def _chunk_types(chat: bool, head: dict) -> tuple[Callable, Callable]:
    """How a stream's events are built: (envelope(choices, usage=None), piece(index, text, finish, role))."""
    if chat:
        def envelope(choices, usage=None):
            return p.ChatCompletionChunk(object="chat.completion.chunk", **head, choices=choices, usage=usage)

        def piece(i: int, text: str | None = None, finish=None, role=None, logprobs=None):
            return p.ChatChunkChoice(index=i, delta=p.ChatDelta(role=role, content=text), logprobs=logprobs,
                                     finish_reason=finish)
    else:
        def envelope(choices, usage=None):
            return p.CompletionChunk(object="text_completion", **head, choices=choices, usage=usage)

        def piece(i: int, text: str | None = None, finish=None, role=None, logprobs=None):
            return p.CompletionChunkChoice(index=i, text=text or "", logprobs=logprobs, finish_reason=finish)
    return envelope, piece


class TokenPieces:
    """Tokens as the logprobs of OpenAI's API name them: each token's own text (a piece of a character reads as
    U+FFFD) and its bytes (a byte-level BPE token's exact bytes, else its text's UTF-8), cached by id."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, tuple[str, list[int]]] = {}
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        if self.byte_level:
            self.byte_of = _byte_level_alphabet()

    def piece(self, token_id: int) -> tuple[str, list[int]]:
        known = self.cache.get(token_id)  # (at most the vocabulary's size: ids come from the model's head)
        if known is None:
            known = self.cache[token_id] = self._piece(token_id)
        return known

    def _piece(self, token_id: int) -> tuple[str, list[int]]:
        if self.tokenizer is None:
            text = f"token_id:{token_id}"
            return text, list(text.encode())
        text = self.tokenizer.decode([token_id])
        if self.byte_level:
            name = self.tokenizer.convert_ids_to_tokens(token_id)
            if name and all(c in self.byte_of for c in name):
                return text, [self.byte_of[c] for c in name]
        return text, list(text.encode())

    def chat_logprobs(self, token_ids: list[int], logprobs) -> p.ChatLogprobs | None:
        if logprobs is None:
            return None
        content = []
        for tok, (logprob, top) in zip(token_ids, logprobs):
            text, raw = self.piece(tok)
            content.append(p.TokenLogprob(token=text, logprob=logprob, bytes=raw, top_logprobs=[
                p.TopLogprob(token=t, logprob=lp, bytes=b) for (t, b), lp in ((self.piece(i), lp) for i, lp in top.items())]))
        return p.ChatLogprobs(content=content)

    def completion_logprobs(self, token_ids: list[int], logprobs, offset: int = 0) -> p.CompletionLogprobs | None:
        if logprobs is None:
            return None
        out = p.CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for tok, (logprob, top) in zip(token_ids, logprobs):
            text = self.piece(tok)[0]
            out.tokens.append(text)
            out.token_logprobs.append(logprob)
            out.top_logprobs.append({**{self.piece(i)[0]: lp for i, lp in top.items()}, text: logprob})
            out.text_offset.append(offset)
            offset += len(text)
        return out


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's character for each byte, inverted: printable Latin-1 bytes stand for themselves, the
    others (controls, space, soft hyphen...) for the characters from U+0100 on, in byte order."""
    shown = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    hidden = [b for b in range(256) if b not in shown]
    return {**{chr(b): b for b in shown}, **{chr(0x100 + i): b for i, b in enumerate(hidden)}}


def _sse(body: msgspec.Struct) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


def _usage(done: Completion) -> p.Usage:
    prompt = len(done.prompt_token_ids)
    completion = sum(len(s.token_ids) for s in done.samples)
    return p.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _most_prompt_bytes(engine: Engine) -> float:
    """The most UTF-8 bytes a prompt can have and still fit the model's context: every token covers at most
    as many bytes as the longest string of the vocabulary (an over-estimate: byte-level vocabularies write
    one byte as up to two)."""
    tok = engine.tokenizer
    if tok is None or engine.max_context == math.inf:
        return math.inf
    return max((len(t.encode()) for t in tok.get_vocab()), default=1) * engine.max_context


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jitney")
    except PackageNotFoundError:
        return "0"


async def _api_error(request: HttpRequest, exc: ApiError) -> Response:
    return json_response(exc.body(), exc.status)


async def _http_error(request: HttpRequest, exc: HTTPException) -> Response:
    return json_response(ApiError(exc.status_code, exc.detail).body(), exc.status_code)


async def _internal_error(request: HttpRequest, exc: Exception) -> Response:
    return json_response(ApiError(500, f"internal error: {type(exc).__name__}", kind="server_error").body(), 500)


def serve(model: str, host: str, port: int, api_key: str | None, max_waiting: int, config, max_n: int = 16,
          record_trace: str | None = None, record_ids: bool = False) -> None:
    """Load `model` and serve it until interrupted (what `jitney serve` runs)."""
    from pathlib import Path

    import uvicorn

    from jitney.plugins.logs import RequestLog, configure_logging

    configure_logging()
    metrics = PrometheusMetrics()
    plugins: list = [metrics, RequestLog()]
    if record_trace:
        from jitney.plugins.trace import TraceRecorder

        plugins.append(TraceRecorder(record_trace, token_ids=record_ids))
    engine = Engine.from_pretrained(model, config=config, plugins=plugins)
    name = model if model == "smollm2" else Path(model).name
    app = build_app(engine, name, metrics, api_key=api_key, max_waiting=max_waiting, max_n=max_n)
    uvicorn.run(app, host=host, port=port, log_level="warning")
