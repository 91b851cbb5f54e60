"""The OpenAI request and response bodies as msgspec structs.

The same structs decode and validate what comes in, encode what goes out, and are what /openapi.json is
generated from, so the published schema states exactly the constraints the server enforces.
"""

# (no `from __future__ import annotations`: the request structs are built in a function, and msgspec reads
# their annotations at run time, when only real objects still see that function's locals)
import re
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from jitney.core.grammar import Grammar
from jitney.core.request import MAX_LOGPROBS, SamplingParams


class ErrorDetail(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(msgspec.Struct, kw_only=True):
    """What every error answers, and the last event of a stream that failed."""

    error: ErrorDetail


class ApiError(Exception):
    """An OpenAI-style error answered with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> ErrorBody:
        return ErrorBody(error=ErrorDetail(message=self.message, type=self.kind, param=self.param, code=None))


# -- responses ---------------------------------------------------------------------------------------------

FinishReason = Literal["stop", "length", "tool_calls"]  # a sample that failed or was cancelled is an error


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct, kw_only=True):
    """A chat token's log-probability and its likeliest alternatives (`top_logprobs` of them)."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[TokenLogprob]
    refusal: None = None


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    """The legacy completions' logprobs: per token its text, log-probability, the likeliest alternatives with the
    drawn token among them, and where its text starts in the completion."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason


class Completion(msgspec.Struct, kw_only=True):
    """The answer of /v1/completions."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(msgspec.Struct, kw_only=True):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletion(msgspec.Struct, kw_only=True):
    """The answer of /v1/chat/completions."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionChunk(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One server-sent event of a streamed completion (`usage` only on the last, when asked for)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class ToolCallDelta(msgspec.Struct, kw_only=True):
    index: int
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One server-sent event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(msgspec.Struct, kw_only=True):
    """The answer of /v1/models."""

    object: Literal["list"]
    data: list[ModelCard]


class Health(msgspec.Struct, kw_only=True):
    """The answer of /health while the engine's step loop runs."""

    status: Literal["ok"]


RESPONSES = (Completion, ChatCompletion, CompletionChunk, ChatCompletionChunk, ModelList, ModelCard, ErrorBody, Health)


# -- requests ----------------------------------------------------------------------------------------------


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # (vLLM's: every chunk carries the usage so far)


class TextPart(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A part of a message's content given as an array: text only (this server serves text models)."""

    type: Literal["text"]
    text: str


class Message(msgspec.Struct, kw_only=True):
    """A chat message as OpenAI's API sends it. `content` may be text, an array of text parts (joined), or null (an
    assistant turn that only called tools); the fields of a tool-call history (`tool_calls`, `tool_call_id`, `name`)
    are accepted so that such a history replays, and reach the chat template as they are."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The content as one string."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """The message as a chat template reads it: its text, and whichever tool-call fields it has."""
        extra = {k: getattr(self, k) for k in ("name", "tool_calls", "tool_call_id") if getattr(self, k) is not None}
        return {"role": self.role, "content": self.text(), **extra}


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema: dict | None = None  # (none: any JSON object)
    strict: bool | None = None  # (the grammar holds every output to the schema either way)


class ResponseFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's `response_format`: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs` extra: exactly one of a JSON schema, a regex, a choice of strings, a Lark
    grammar."""

    json: dict | None = None
    regex: str | None = None
    choice: Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(min_length=1)] | None = None
    grammar: str | None = None


class FunctionDef(msgspec.Struct, kw_only=True):
    name: Annotated[str, Meta(pattern="^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments (none: any object)
    strict: bool | None = None  # (a required or named call's arguments match the schema either way)


class Tool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    function: NamedFunction


Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]  # a torch generator's range (sample i uses seed + i)
StopString = Annotated[str, Meta(min_length=1)]
Stop = StopString | Annotated[list[StopString], Meta(max_length=4)] | None  # at most 4, as OpenAI's API
Penalty = Annotated[float, Meta(ge=-2, le=2)] | None
Bias = Annotated[float, Meta(ge=-100, le=100)]
TopLogprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None


def request_bodies(model_name: str, max_n: int, vocab_size: int, max_tokens: int | None = None) -> tuple[type, type]:
    """The (completion, chat) request structs of a server of `model_name` with these limits: `n` up to `max_n`,
    token ids below `vocab_size`, `max_tokens` up to `max_tokens` when set (the model's context bounds it
    anyway). `parse` answers another model's name with 404, before the struct would call it invalid."""
    n_type = Annotated[int, Meta(ge=1, le=max_n)]
    tokens = Annotated[int, Meta(ge=1)] if max_tokens is None else Annotated[int, Meta(ge=1, le=max_tokens)]
    token_id = Annotated[int, Meta(ge=0, lt=vocab_size)]

    class _Common(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
        model: Literal[model_name]  # type: ignore[valid-type]
        temperature: Annotated[float, Meta(ge=0)] | None = None  # null: 1, as OpenAI's API
        top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
        seed: Seed | None = None
        stop: Stop = None
        n: n_type = 1
        stream: bool = False
        stream_options: StreamOptions | None = None
        user: str | None = None  # an end-user id: the request's metadata["user"], for schedulers and logs
        metadata: dict[str, str] | None = None  # OpenAI's request metadata: the request's metadata too
        presence_penalty: Penalty = None
        frequency_penalty: Penalty = None
        logit_bias: dict[str, Bias] | None = None  # token id (as a string) -> bias
        # the common extras (vLLM's names)
        top_k: Annotated[int, Meta(ge=-1)] | None = None  # -1 or 0: every token
        min_p: Annotated[float, Meta(ge=0, le=1)] | None = None
        repetition_penalty: Annotated[float, Meta(ge=0.01, le=100)] | None = None
        min_tokens: Annotated[int, Meta(ge=0)] | None = None
        response_format: ResponseFormat | None = None
        structured_outputs: StructuredOutputs | None = None

    class CompletionBody(_Common, kw_only=True):
        prompt: Annotated[str, Meta(min_length=1)] | Annotated[list[token_id], Meta(min_length=1)]
        max_tokens: tokens = 16
        logprobs: TopLogprobs = None  # the alternatives listed beside each token's (the drawn one among them)
        echo: bool | None = None  # the prompt's text before the completion's (not its logprobs)

        def asked_logprobs(self) -> int | None:
            return self.logprobs

    class ChatBody(_Common, kw_only=True):
        messages: Annotated[list[Message], Meta(min_length=1)]
        max_tokens: tokens | None = None
        max_completion_tokens: tokens | None = None
        logprobs: bool | None = None
        top_logprobs: TopLogprobs = None
        tools: list[Tool] | None = None
        tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
        parallel_tool_calls: bool | None = None  # (false: a required choice makes one call; a named one always does)

        def offered_tools(self) -> list[dict] | None:
            """The tools as the chat template and the grammar read them; None where none are offered (no tools, or
            `tool_choice` none)."""
            if not self.tools or self.tool_choice == "none":
                if isinstance(self.tool_choice, NamedToolChoice) or self.tool_choice == "required":
                    raise ApiError(400, f"tool_choice {msgspec.to_builtins(self.tool_choice)!r} needs tools",
                                   param="tool_choice")
                return None
            return msgspec.to_builtins(self.tools)

        def asked_logprobs(self) -> int | None:
            if self.top_logprobs and not self.logprobs:
                raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            return (self.top_logprobs or 0) if self.logprobs else None

    return CompletionBody, ChatBody


_WHERE = re.compile(r"^(?P<what>.*) - at `\$\.(?P<field>[A-Za-z_]+)(?P<rest>[^`]*)`$")
_MISSING = re.compile(r"missing required field `([A-Za-z_]+)`$")


NEUTRAL: dict[str, tuple] = {
    "echo": (None, False), "best_of": (None, 1), "tools": (None, []), "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, True, False), "functions": (None, []), "function_call": (None, "none"),
}
"""Fields this server does not implement, each with the values that ask for nothing of it (OpenAI's defaults, and
null): SDKs and frameworks send them as they are; a body with any other value of them is refused with a 400."""


def _neutral(name: str, value) -> bool:
    # (`0 == False` in Python: a boolean counts only where a boolean is listed, so that `logprobs: 0` is no neutral)
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in NEUTRAL.get(name, ()))


def parse(raw: bytes, kind: type[msgspec.Struct], model: str):
    """Decode a request body for `model`; unknown (unsupported) fields are named in a 400, as are bad values, unless
    they hold a value that asks for nothing (`NEUTRAL`); another model's name is a 404."""
    try:
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"malformed JSON body: {exc}") from None
    except RecursionError:
        raise ApiError(400, "malformed JSON body: nested too deeply") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    data = {k: v for k, v in data.items() if k in kind.__struct_fields__ or not _neutral(k, v)}
    prompts = data.get("prompt") if "prompt" in kind.__struct_fields__ else None
    if isinstance(prompts, list) and prompts and all(isinstance(x, str) for x in prompts):
        if len(prompts) > 1:  # (OpenAI's batch of prompts: not served here)
            raise ApiError(400, f"a list of {len(prompts)} prompts: this server takes one prompt a request (a string, "
                                "or a list of token ids); send them as requests of their own", param="prompt")
        data["prompt"] = prompts[0]  # (a batch of one, as some clients send every prompt)
    unsupported = sorted(set(data) - set(kind.__struct_fields__))
    if unsupported:
        raise ApiError(400, f"unsupported field(s): {', '.join(unsupported)}", param=unsupported[0])
    asked = data.get("model")
    if isinstance(asked, str) and asked != model:
        raise ApiError(404, f"model {asked!r} does not exist; this server has {model!r}", param="model",
                       kind="model_not_found")
    try:
        return msgspec.convert({k: _integral(v) for k, v in data.items()}, kind)
    except msgspec.ValidationError as exc:
        raise _invalid(str(exc)) from None


def _integral(value):
    """JSON Schema counts 1.0 as an integer, msgspec does not: whole floats become ints, at the top level
    and in lists there (a token-id prompt), the only places the bodies have integers."""
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if isinstance(value, list):
        return [int(v) if isinstance(v, float) and v.is_integer() else v for v in value]
    return value


def _invalid(message: str) -> ApiError:
    """A 400 naming the field msgspec's message points at (``... - at `$.n```)."""
    where = _WHERE.match(message)
    if where is None:
        missing = _MISSING.search(message)
        return ApiError(400, message, param=missing[1] if missing else None)
    field = where["field"]
    if "length >= 1" in where["what"] and not where["rest"]:
        return ApiError(400, f"{field} must not be empty", param=field)
    return ApiError(400, f"invalid {field}: {where['what'][0].lower()}{where['what'][1:]}"
                         f"{' at ' + field + where['rest'] if where['rest'] else ''}", param=field)


def grammar_of(body) -> Grammar | None:
    """The grammar a body asks its output to match (`response_format`, or the `structured_outputs` extra)."""
    fmt, extra = body.response_format, body.structured_outputs
    if fmt is not None and fmt.type != "text" and extra is not None:
        raise ApiError(400, "response_format and structured_outputs both constrain the output: send one",
                       param="structured_outputs")
    if fmt is not None and fmt.type == "json_object":
        return Grammar.json()
    if fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise ApiError(400, "response_format json_schema needs its json_schema", param="response_format")
        return Grammar.json(fmt.json_schema.schema)
    if extra is None:
        return None
    given = [k for k in ("json", "regex", "choice", "grammar") if getattr(extra, k) is not None]
    if len(given) != 1:
        raise ApiError(400, f"structured_outputs takes exactly one of json, regex, choice, grammar (got "
                            f"{', '.join(given) or 'none'})", param="structured_outputs")
    kind = given[0]
    return {"json": Grammar.json, "regex": Grammar.regex, "choice": Grammar.choice,
            "grammar": Grammar.lark}[kind](getattr(extra, kind))


def sampling(body, max_tokens: int | None, default_max: int) -> SamplingParams:
    """Map the OpenAI sampling fields (null: the default); a bad value is a 400 that says which."""
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    try:
        bias = {int(k): v for k, v in body.logit_bias.items()} if body.logit_bias else None
    except ValueError:
        raise ApiError(400, "logit_bias keys must be token ids", param="logit_bias") from None
    try:
        return SamplingParams(
            max_new_tokens=default_max if max_tokens is None else max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature, top_p=body.top_p or 1.0, seed=body.seed, stop=stop, n=body.n, presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0, logit_bias=bias, top_k=max(0, body.top_k or 0),
            min_p=body.min_p or 0.0, repetition_penalty=body.repetition_penalty or 1.0,
            min_tokens=body.min_tokens or 0,
            logprobs=body.asked_logprobs(), grammar=grammar_of(body),
        )
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None
