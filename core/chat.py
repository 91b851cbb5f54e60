"""Chat prompts and tool calls, the same for the library (`Engine.chat`) and the server.

A model's chat template renders the messages. Where the template takes `tools` itself (Qwen, SmolLM3, Llama 3.1...),
the tools go to it as they are; where it does not (SmolLM2), they are described in the system message, and the
model is asked for Hermes-style calls, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, which is
also how an assistant turn's `tool_calls` of the history are written back for such a template. `parse_tool_calls`
reads calls of that form out of a reply; `tool_grammar` holds a reply to them where a call is required.
"""

from __future__ import annotations

import json
import re
import uuid

from jitney.core.grammar import Grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)


def takes_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders `tools` itself."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tools" in (template if isinstance(template, str) else json.dumps(template))


def prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The token ids of `messages` (OpenAI's shapes: text or text parts, tool-call turns, tool results) under the
    tokenizer's chat template, with the generation prompt, and `tools` (OpenAI's function tools) offered."""
    if tokenizer is None:
        raise ValueError("a chat needs the model's tokenizer (its chat template)")
    messages = [_plain(m) for m in messages]
    native = takes_tools(tokenizer)
    if tools and not native:
        messages = _with_tools_described(messages, tools)
    if not native:
        messages = [_calls_as_text(m) for m in messages]
    kw = {"tools": tools} if tools and native else {}
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kw)["input_ids"])


def _plain(message: dict) -> dict:
    """A message with its content as text (an array of text parts joined; null as empty)."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return {**message, "content": content or ""}


def _calls_as_text(message: dict) -> dict:
    calls = message.get("tool_calls")
    if not calls:
        return message
    text = "".join(f"{OPEN}{json.dumps(_call_of(c))}{CLOSE}" for c in calls)
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": (message["content"] + "\n" if message["content"] else "") + text}


def _call_of(call: dict) -> dict:
    """{"name", "arguments"} of a history's tool call (OpenAI's: arguments as a JSON string)."""
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    return {"name": fn.get("name"), "arguments": args}


def _with_tools_described(messages: list[dict], tools: list[dict]) -> list[dict]:
    described = (
        "You can call functions. Their signatures, as JSON schemas, are within <tools></tools>:\n<tools>\n"
        + "\n".join(json.dumps(t.get("function", t)) for t in tools)
        + "\n</tools>\nTo call one, reply with a JSON object of its name and arguments within "
          f'{OPEN}{CLOSE} tags, one per call: {OPEN}{{"name": <name>, "arguments": <arguments>}}{CLOSE}'
    )
    if messages and messages[0]["role"] in ("system", "developer"):
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + described}, *messages[1:]]
    return [{"role": "system", "content": described}, *messages]


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """The calls a reply makes (``{"id", "type": "function", "function": {"name", "arguments" (a JSON string)}}``, as
    OpenAI's API returns them) and the text around them (None where there is none): Hermes-style blocks
    (``<tool_call>{...}</tool_call>``: Qwen, SmolLM, and the form asked of templates without tools), or a reply
    that is nothing but a call object or a list of them (``{"name": ..., "parameters": ...}``: Llama 3.1's
    templates; Mistral's list, its special token skipped). A block that is not a JSON object with a name stays
    text."""
    calls, kept, last = [], [], 0
    for m in _CALL.finditer(text):
        call = _as_call(m.group(1))
        if call is None:
            continue
        calls.append(call)
        kept.append(text[last : m.start()])
        last = m.end()
    kept.append(text[last:])
    if calls:
        return "".join(kept).strip() or None, calls
    whole = text.strip()
    if whole[:1] in ("{", "["):
        try:
            value = json.loads(whole)
        except json.JSONDecodeError:
            return text, []
        found = [_as_call(v) for v in (value if isinstance(value, list) else [value])]
        if found and all(c is not None for c in found):
            return None, found
    return text, []


def _as_call(call) -> dict | None:
    """OpenAI's form of one call given as JSON (text or parsed), or None where it is not one."""
    if isinstance(call, str):
        try:
            call = json.loads(call)
        except json.JSONDecodeError:
            return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    args = call.get("arguments", call.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


def tool_grammar(tools: list[dict], choice, parallel: bool = True) -> Grammar | None:
    """The grammar a reply must match under `tool_choice`: "required" (a call of any of `tools`, one or more; one
    where not `parallel`) or a named function (one call of it); None for "auto" and "none" (free text)."""
    if choice in (None, "auto", "none"):
        return None
    fns = [t.get("function", t) for t in tools]
    if isinstance(choice, dict):
        name = choice.get("function", {}).get("name")
        fns = [f for f in fns if f.get("name") == name]
        if not fns:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
    elif choice != "required":
        raise ValueError(f"tool_choice must be none, auto, required or a named function (got {choice!r})")
    options = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                 "arguments": _closed(f.get("parameters") or {"type": "object"})},
                "required": ["name", "arguments"], "additionalProperties": False} for f in fns]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    call = f'"{OPEN}" %json {json.dumps(schema)} "{CLOSE}"'
    many = "+" if choice == "required" and parallel else ""
    return Grammar.lark(f"start: call{many}\ncall: {call}\n")


def _closed(schema):
    """A function's parameters with no properties beyond those it declares, where it does not say otherwise (JSON
    Schema allows any by default, and a small model, free to add some, may not stop)."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
