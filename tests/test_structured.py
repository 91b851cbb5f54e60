"""Structured output: outputs that match their grammar (drawn JSON schemas, regexes, choices) on the embedded SmolLM2,
through the library and the server; a grammar that cannot compile fails its request alone, or is a 400."""

from __future__ import annotations

import json
import random
import re

import anyio
import jsonschema
import msgspec
import pytest
from support import complete_all
from test_speculative import Steps

from jitney import Engine, EngineConfig, Grammar, Request, SamplingParams
from jitney.core.chat import tool_grammar

CONFIG = EngineConfig(num_blocks=512, max_batch_tokens=256)


def draw_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON schema whose every instance is short (strings, arrays and numbers bounded)."""
    kinds = ["string", "integer", "boolean", "enum"] + (["array", "object"] if depth < 2 else [])
    kind = rng.choice(kinds) if depth else "object"
    if kind == "string":
        return {"type": "string", "minLength": 1, "maxLength": rng.randint(1, 12)}
    if kind == "integer":
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 1000)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 3, 7.5, True, None, "a b"], rng.randint(1, 4))}
    if kind == "array":
        return {"type": "array", "items": draw_schema(rng, depth + 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    names = rng.sample(["name", "size", "colour", "tags", "ok", "id", "parts", "when"], rng.randint(1, 3))
    props = {n: draw_schema(rng, depth + 1) for n in names}
    return {"type": "object", "properties": props, "required": rng.sample(names, rng.randint(0, len(names))),
            "additionalProperties": False}


def chat_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)["input_ids"])


async def run(smollm2, requests):
    model, tokenizer = smollm2
    async with Engine(model, tokenizer, CONFIG) as engine:
        return await complete_all(engine, requests)


def test_grammar_values():
    assert Grammar.json({"type": "integer"}) == Grammar("json", '{"type": "integer"}')
    assert Grammar.json().spec == "" and Grammar.choice(("a", "b")).spec == '["a", "b"]'
    with pytest.raises(ValueError, match="kind"):
        Grammar("yaml", "")
    with pytest.raises(ValueError, match="non-empty"):
        Grammar.choice([])


async def test_every_output_of_drawn_json_schemas_validates(smollm2):
    """24 schemas drawn at random (nested objects, arrays, enums, bounded strings and integers), half greedy, half
    sampled: each output parses and validates, and ends on its own (validity is the grammar's job, not the model's)."""
    rng = random.Random(7)
    schemas = [draw_schema(rng) for _ in range(24)]
    ids = chat_ids(smollm2[1], "Describe a small object as JSON.")
    requests = [Request(ids, SamplingParams(max_new_tokens=200, grammar=Grammar.json(s), temperature=0.0 if i % 2 else 0.9,
                                            seed=i)) for i, s in enumerate(schemas)]
    for schema, done in zip(schemas, await run(smollm2, requests)):
        assert done.finish_reason == "stop", (schema, done.text)
        jsonschema.validate(json.loads(done.text), schema)


async def test_greedy_grammar_rows_take_prompt_lookups_guesses_checked_under_the_mask(smollm2):
    """Prompt lookup's guesses for greedy rows held to a grammar are checked under its mask: the tokens are those
    of decode steps one after another, and guesses are accepted (the draft stays out: it proposes unmasked)."""
    model, tokenizer = smollm2
    rng = random.Random(3)
    schemas = [draw_schema(rng) for _ in range(3)]
    ids = chat_ids(tokenizer, "Describe a small object as JSON: " + json.dumps(schemas[0]))
    requests = [Request(ids, SamplingParams(max_new_tokens=120, grammar=Grammar.json(s))) for s in schemas]

    async def complete(**config):
        steps = Steps()
        async with Engine(model, tokenizer, msgspec.structs.replace(CONFIG, **config), plugins=[steps]) as engine:
            return await complete_all(engine, requests), steps

    plain, _ = await complete(speculative_tokens=0, lookup_tokens=0)
    done, steps = await complete(speculative_tokens=4, lookup_tokens=4)
    assert [c.token_ids for c in done] == [c.token_ids for c in plain]
    assert sum(s.accepted_tokens for s in steps.steps) > 0
    for schema, c in zip(schemas, done):
        jsonschema.validate(json.loads(c.text), schema)


async def test_regex_choice_and_any_object_beside_plain_requests(smollm2):
    tokenizer = smollm2[1]
    ids = chat_ids(tokenizer, "Give me a product code.")
    plain = SamplingParams(max_new_tokens=12)
    code, pick, obj, free, bad = await run(smollm2, [
        Request(ids, SamplingParams(max_new_tokens=20, grammar=Grammar.regex(r"[A-Z]{3}-[0-9]{4}"))),
        Request(ids, SamplingParams(max_new_tokens=20, grammar=Grammar.choice(["alpha", "beta", "gamma ray"]))),
        Request(ids, SamplingParams(max_new_tokens=200, grammar=Grammar.json({"type": "object", "properties": {
            "code": {"type": "string", "maxLength": 8}}, "required": ["code"]}))),
        Request(ids, plain),
        Request(ids, SamplingParams(max_new_tokens=20, grammar=Grammar.json('{"type": "integer", "minimum": "x"'))),
    ])
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{4}", code.text) and code.finish_reason == "stop"
    assert pick.text in ("alpha", "beta", "gamma ray") and pick.finish_reason == "stop"
    assert isinstance(json.loads(obj.text)["code"], str)
    assert bad.finish_reason == "error" and "logits processor 'grammar' failed" in bad.error and "not JSON" in bad.error
    [unspellable] = await run(smollm2, [Request(ids, SamplingParams(max_new_tokens=5, grammar=Grammar.regex("\U0009adad")))])
    assert unspellable.finish_reason == "error" and "cannot be followed with this model's tokens" in unspellable.error
    assert free.token_ids == (await run(smollm2, [Request(ids, plain)]))[0].token_ids  # (its batch went on)


async def test_engine_chat_applies_the_template_as_the_server_does(smollm2):
    """`Engine.chat` is the server's prompt: the tokenizer's template with the generation prompt; tools described
    in the system message for a template without them; a call read back with `parse_tool_calls`."""
    from jitney.core.chat import parse_tool_calls, prompt_ids

    model, tokenizer = smollm2
    messages = [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]
    ids = list(tokenizer.apply_chat_template([{"role": "user", "content": "Name a colour."}],
                                             add_generation_prompt=True)["input_ids"])
    tools = [{"type": "function", "function": {"name": "paint", "parameters": {"type": "object", "properties": {
        "colour": {"type": "string", "maxLength": 10}}, "required": ["colour"]}}}]
    async with Engine(model, tokenizer, CONFIG) as engine:
        chat = await engine.chat(messages, SamplingParams(max_new_tokens=8))
        plain = await engine.generate(Request(ids, SamplingParams(max_new_tokens=8)))
        with_tools = prompt_ids(tokenizer, messages, tools)
        call = await engine.generate(Request(with_tools, SamplingParams(
            max_new_tokens=60, grammar=tool_grammar(tools, "required"))))
    assert chat.prompt_token_ids == ids and chat.text == plain.text
    assert "paint" in tokenizer.decode(with_tools) and len(with_tools) > len(ids)
    content, calls = parse_tool_calls(call.text)
    assert content is None and calls[0]["function"]["name"] == "paint"
    assert isinstance(json.loads(calls[0]["function"]["arguments"])["colour"], str)


def test_parse_tool_calls_reads_hermes_blocks_and_leaves_the_rest():
    from jitney.core.chat import parse_tool_calls

    content, calls = parse_tool_calls('Checking. <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>'
                                      '<tool_call>not json</tool_call>')
    assert [c["function"]["name"] for c in calls] == ["a"] and json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    assert content == "Checking. <tool_call>not json</tool_call>"
    assert parse_tool_calls("no calls") == ("no calls", [])


def test_a_required_call_is_one_call_where_calls_are_not_parallel():
    tools = [{"type": "function", "function": {"name": "a"}}]
    assert tool_grammar(tools, "required").spec.startswith("start: call+\n")
    assert tool_grammar(tools, "required", parallel=False).spec.startswith("start: call\n")
    assert tool_grammar(tools, "auto") is None
    with pytest.raises(ValueError, match="'b', which is not among the tools"):
        tool_grammar(tools, {"type": "function", "function": {"name": "b"}})


def test_llm_chat_is_engine_chat(smollm2):
    from jitney import LLM

    model, tokenizer = smollm2
    conversation = [{"role": "user", "content": "Name a colour."}]

    async def direct():
        async with Engine(model, tokenizer, CONFIG) as engine:
            return await engine.chat(conversation, SamplingParams(max_new_tokens=6))

    [done] = LLM(model, CONFIG, tokenizer).chat([conversation], SamplingParams(max_new_tokens=6), progress=False)
    assert done.token_ids == anyio.run(direct).token_ids


def test_parse_tool_calls_reads_a_reply_that_is_only_json_calls():
    from jitney.core.chat import parse_tool_calls

    content, calls = parse_tool_calls(' {"name": "weather", "parameters": {"city": "Oslo"}}')
    assert content is None and calls[0]["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    content, calls = parse_tool_calls('[{"name": "a", "arguments": {}}, {"name": "b", "arguments": "{\\"x\\": 1}"}]')
    assert [c["function"]["arguments"] for c in calls] == ["{}", '{"x": 1}']
    assert parse_tool_calls('{"colour": "red"}') == ('{"colour": "red"}', [])  # (JSON, but no call)
    assert parse_tool_calls("[1, 2") == ("[1, 2", [])
