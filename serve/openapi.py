"""The server's OpenAPI 3.1 document, generated from the msgspec structs it decodes and encodes with."""

from __future__ import annotations

import msgspec

from jitney.serve.protocol import (
    RESPONSES, ChatCompletion, ChatCompletionChunk, Completion, CompletionChunk, ErrorBody, Health, ModelCard, ModelList,
)

_REF = "#/components/schemas/{name}"
_ERRORS = {
    400: "the body is malformed, or a field is unsupported or out of range (`param` names it)",
    401: "missing or wrong API key",
    404: "no such model",
    413: "the request body is too large",
    429: "too many samples waiting; retry later",
    500: "the engine failed while generating",
    503: "the engine is not running, or the request was cancelled because the server is shutting down",
}


def openapi(completion_body: type, chat_body: type, secured: bool, version: str) -> dict:
    """The document for a server whose request structs are `completion_body` and `chat_body`."""
    structs = (completion_body, chat_body, *RESPONSES)
    refs, components = msgspec.json.schema_components(structs, ref_template=_REF)
    ref = dict(zip(structs, refs))
    # (a batch of one prompt, which `parse` takes as that prompt: not a type the struct can say)
    components[completion_body.__name__]["properties"]["prompt"]["anyOf"].append(
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1})

    def error(status: int) -> tuple[str, dict]:
        media = {"application/json": {"schema": ref[ErrorBody]}}
        return str(status), {"description": _ERRORS[status], "content": media}

    def answers(status: int, description: str, media: dict, errors: tuple[int, ...]) -> dict:
        errors = tuple(e for e in errors if secured or e != 401)
        return {str(status): {"description": description, "content": media}, **dict(map(error, errors))}

    def generation(body: type, answer: type, chunk: type, summary: str) -> dict:
        # (OpenAPI 3.1: the schema of an event-stream media type describes one event)
        json_data = {"type": "string", "contentMediaType": "application/json",
                     "contentSchema": {"anyOf": [ref[chunk], ref[ErrorBody]]}}
        event = {"type": "object", "required": ["data"],
                 "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]}},
                 "description": f"with `stream: true`: one `{chunk.__name__}` per event; a request that fails after "
                                "the stream began ends with an `ErrorBody` event; the last event is `[DONE]`"}
        media = {"application/json": {"schema": ref[answer]}, "text/event-stream": {"schema": event}}
        return {"post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": ref[body]}}},
            "responses": answers(200, "the completion, or its stream", media, (400, 401, 404, 413, 429, 500, 503)),
        }}

    public = {"security": []}
    paths = {
        "/v1/completions": generation(completion_body, Completion, CompletionChunk, "complete a prompt"),
        "/v1/chat/completions": generation(chat_body, ChatCompletion, ChatCompletionChunk, "answer a conversation"),
        "/v1/models": {"get": {"summary": "the model served", "responses": answers(
            200, "the model list", {"application/json": {"schema": ref[ModelList]}}, (401,))}},
        "/v1/models/{model}": {"get": {
            "summary": "the model served, by its id",
            "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": answers(200, "its card", {"application/json": {"schema": ref[ModelCard]}}, (401, 404))}},
        "/health": {"get": {"summary": "whether the engine's step loop runs", **public, "responses": answers(
            200, "it runs", {"application/json": {"schema": ref[Health]}}, (503,))}},
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": answers(
            200, "the text exposition format", {"text/plain": {"schema": {"type": "string"}}}, (401,))}},
        "/openapi.json": {"get": {"summary": "this document", **public, "responses": answers(
            200, "the OpenAPI document", {"application/json": {"schema": {"type": "object"}}}, ())}},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "jitney", "version": version, "description": "An OpenAI-compatible API over jitney's engine"},
        "paths": paths,
        "components": {"schemas": components, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        **({"security": [{"bearer": []}]} if secured else {}),
    }
