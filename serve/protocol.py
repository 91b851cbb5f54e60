"""The OpenAI request bodies we accept, and how they map onto `SamplingParams`."""

from __future__ import annotations

import msgspec

from jitney.core.request import SamplingParams


class ApiError(Exception):
    """An OpenAI-style error answered with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class Message(msgspec.Struct):
    role: str
    content: str


class _Common(msgspec.Struct, kw_only=True):
    model: str
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the caller's own records; accepted and ignored


class CompletionBody(_Common, kw_only=True):
    prompt: str | list[int]
    max_tokens: int = 16


class ChatBody(_Common, kw_only=True):
    messages: list[Message]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None


def parse(raw: bytes, kind: type[msgspec.Struct]):
    """Decode a request body; unknown (unsupported) fields are named in a 400, as are bad values."""
    try:
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"malformed JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    unsupported = sorted(set(data) - set(kind.__struct_fields__))
    if unsupported:
        raise ApiError(400, f"unsupported field(s): {', '.join(unsupported)}", param=unsupported[0])
    try:
        return msgspec.convert(data, kind)
    except msgspec.ValidationError as exc:
        raise ApiError(400, str(exc)) from None


def sampling(body: CompletionBody | ChatBody, max_tokens: int | None, default_max: int) -> SamplingParams:
    """Map the OpenAI sampling fields; a bad value is a 400 that says which."""
    max_new = default_max if max_tokens is None else max_tokens
    if max_new < 1:
        raise ApiError(400, f"max_tokens must be >= 1 (got {max_new})", param="max_tokens")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    try:
        return SamplingParams(max_new_tokens=max_new, temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                              stop=stop, n=body.n)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None
