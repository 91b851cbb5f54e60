"""The Starlette application: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""

from __future__ import annotations

import time
import uuid
from contextlib import asynccontextmanager

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from jitney.core.engine import Engine
from jitney.core.request import Request, cut_at_stop
from jitney.plugins.metrics import PrometheusMetrics
from jitney.serve.protocol import ApiError, ChatBody, CompletionBody, parse, sampling


def build_app(
    engine: Engine, model_name: str, metrics: PrometheusMetrics, api_key: str | None = None, max_waiting: int = 256,
    max_body_bytes: int = 1 << 20,
) -> Starlette:
    """An app serving `engine` under `model_name`; the engine runs for the app's lifetime."""

    async def guard(request: HttpRequest, kind):
        """Authorization, body size, overload and model checks shared by both generation endpoints."""
        if int(request.headers.get("content-length") or 0) > max_body_bytes:
            raise ApiError(413, f"request body over {max_body_bytes} bytes")
        raw = await request.body()
        if len(raw) > max_body_bytes:
            raise ApiError(413, f"request body over {max_body_bytes} bytes")
        body = parse(raw, kind)
        if body.model != model_name:
            raise ApiError(404, f"model {body.model!r} does not exist; this server has {model_name!r}",
                           param="model", kind="model_not_found")
        if len(engine.waiting) >= max_waiting:
            raise ApiError(429, f"the server is at capacity ({max_waiting} requests waiting); retry later",
                           kind="rate_limit_exceeded")
        return body

    def submit(prompt, params) -> tuple[Request, object]:
        req = Request(prompt, params, request_id=f"cmpl-{uuid.uuid4().hex[:20]}")
        try:
            return req, engine.stream(req)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None

    async def completions(request: HttpRequest) -> Response:
        body = await guard(request, CompletionBody)
        if body.prompt in ("", []):
            raise ApiError(400, "the prompt is empty", param="prompt")
        params = sampling(body, body.max_tokens, 16)
        req, stream = submit(body.prompt, params)
        return await respond(body, req, stream, chat=False)

    async def chat(request: HttpRequest) -> Response:
        body = await guard(request, ChatBody)
        if not body.messages:
            raise ApiError(400, "messages must not be empty", param="messages")
        tok = engine.tokenizer
        messages = [{"role": m.role, "content": m.content} for m in body.messages]
        try:
            ids = list(tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
        except Exception as exc:  # the template's own message (e.g. roles out of order)
            raise ApiError(400, f"cannot apply the chat template: {exc}", param="messages") from None
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = sampling(body, limit, max(1, min(1024, engine.max_context - len(ids))))
        req, stream = submit(ids, params)
        return await respond(body, req, stream, chat=True)

    async def respond(body, req: Request, stream, chat: bool) -> Response:
        kind = "chat.completion" if chat else "text_completion"
        created = int(time.time())
        if not body.stream:
            async with stream:
                async for _ in stream:
                    pass
            done = stream.completion()
            choices = [
                {"index": s.index, "finish_reason": _reason(s.finish_reason), "logprobs": None,
                 **({"message": {"role": "assistant", "content": s.text}} if chat else {"text": s.text})}
                for s in done.samples
            ]
            return JSONResponse({"id": req.request_id, "object": kind, "created": created, "model": model_name,
                                 "choices": choices, "usage": _usage(done)})

        include_usage = body.stream_options is not None and body.stream_options.include_usage
        holdback = max(map(len, req.params.stop), default=1) - 1  # text that could still become a stop string

        def chunk(choices, usage=None) -> bytes:
            payload = {"id": req.request_id, "object": f"{kind}.chunk" if chat else kind, "created": created,
                       "model": model_name, "choices": choices}
            if usage is not None:
                payload["usage"] = usage
            return b"data: " + msgspec.json.encode(payload) + b"\n\n"

        def piece(index: int, text: str, finish: str | None = None) -> dict:
            if chat:
                return {"index": index, "delta": {"content": text} if text or finish is None else {}, "finish_reason": finish}
            return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}

        async def events():
            texts, sent = {}, {}
            async with stream:
                if chat:
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                                 for i in range(req.params.n)])
                async for token in stream:
                    i = token.index
                    texts[i] = texts.get(i, "") + token.text
                    visible = cut_at_stop(texts[i], req.params.stop)[0]
                    end = max(sent.get(i, 0), len(visible) - holdback)
                    if end > sent.get(i, 0):
                        yield chunk([piece(i, visible[sent.get(i, 0) : end])])
                        sent[i] = end
                done = stream.completion()
            for s in done.samples:
                yield chunk([piece(s.index, s.text[sent.get(s.index, 0) :], _reason(s.finish_reason))])
            if include_usage:
                yield chunk([], _usage(done))
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(request: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "jitney"}]})

    async def health(request: HttpRequest) -> Response:
        return JSONResponse({"status": "ok"})

    async def prometheus(request: HttpRequest) -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    async def api_error(request: HttpRequest, exc: ApiError) -> Response:
        return JSONResponse(exc.body(), status_code=exc.status)

    async def http_error(request: HttpRequest, exc) -> Response:
        return JSONResponse(ApiError(exc.status_code, exc.detail).body(), status_code=exc.status_code)

    @asynccontextmanager
    async def lifespan(app):
        async with engine:
            yield

    class BearerAuth:
        """Every endpoint but /health needs ``Authorization: Bearer <api_key>`` when a key is set."""

        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if scope["type"] == "http" and api_key and scope["path"] != "/health":
                headers = dict(scope["headers"])
                if headers.get(b"authorization", b"").decode() != f"Bearer {api_key}":
                    err = ApiError(401, "missing or wrong API key", kind="authentication_error")
                    return await JSONResponse(err.body(), status_code=401)(scope, receive, send)
            await self.app(scope, receive, send)

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", models),
            Route("/health", health),
            Route("/metrics", prometheus),
        ],
        exception_handlers={ApiError: api_error, HTTPException: http_error},
        middleware=[Middleware(BearerAuth)],
        lifespan=lifespan,
    )


def _reason(finish_reason: str) -> str:
    return "length" if finish_reason == "length" else "stop"


def _usage(done) -> dict:
    prompt = len(done.prompt_token_ids)
    completion = sum(len(s.token_ids) for s in done.samples)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def serve(model: str, host: str, port: int, api_key: str | None, max_waiting: int, config) -> None:
    """Load `model` and serve it until interrupted (what `jitney serve` runs)."""
    from pathlib import Path

    import uvicorn

    from jitney.plugins.logs import RequestLog, configure_logging

    configure_logging()
    metrics = PrometheusMetrics()
    engine = Engine.from_pretrained(model, config=config, plugins=[metrics, RequestLog()])
    name = model if model == "smollm2" else Path(model).name
    app = build_app(engine, name, metrics, api_key=api_key, max_waiting=max_waiting)
    uvicorn.run(app, host=host, port=port, log_level="warning")
