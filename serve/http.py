"""HTTP plumbing of the server: a bounded body reader, bearer-key authorization, and noticing a client leave."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

import anyio
import msgspec
from starlette.requests import Request as HttpRequest
from starlette.responses import Response

from jitney.serve.protocol import ApiError

T = TypeVar("T")


def json_response(body: msgspec.Struct, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """`body` encoded by its struct (the schema /openapi.json publishes for it)."""
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json", headers=headers)


async def read_body(request: HttpRequest, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it passes `limit` bytes: a declared Content-Length over it
    before reading anything, a chunked body once what arrived passes it (never buffering more)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body over {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def unless_disconnected(request: HttpRequest, work: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
    """Run `work` while watching the connection: (True, its result), or (False, None) once the client has
    left, `work` then cancelled (which aborts the request it waits on). Call it after reading the body: the
    next ASGI message is then the disconnect, if any."""
    outcome: list = []  # [result] or [None, exception]: raised outside the task group, not as a group of one
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            outcome.append(await work())
        except Exception as exc:
            outcome += [None, exc]
        tg.cancel_scope.cancel()
    if len(outcome) == 2:
        raise outcome[1]
    return (True, outcome[0]) if outcome else (False, None)


class BearerAuth:
    """ASGI middleware: every path but `public` needs ``Authorization: Bearer <api_key>`` when a key is set."""

    def __init__(self, app, api_key: str | None, public: Iterable[str] = ()):
        self.app = app
        # compared as bytes, in constant time: a header that is not UTF-8 is just a wrong key
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.public = frozenset(public)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.expected is not None and scope["path"] not in self.public:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                err = ApiError(401, "missing or wrong API key", kind="authentication_error")
                return await json_response(err.body(), 401)(scope, receive, send)
        await self.app(scope, receive, send)
