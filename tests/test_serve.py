"""The OpenAI-compatible server on a loopback port, driven by the real `openai` client."""

from __future__ import annotations

import re
import time

import anyio
import httpx
import openai
import pytest
from starlette.testclient import TestClient
from support import serving

from jitney import Engine, EngineConfig, Request, SamplingParams
from jitney.plugins.metrics import PrometheusMetrics
from jitney.serve.app import build_app

KEY = "test-key"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a color."}]
CONFIG = EngineConfig(num_blocks=256, max_batch_tokens=128)
SHAPED = dict(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3, min_tokens=4, top_k=5)


@pytest.fixture(scope="module")
def expected(smollm2):
    """Greedy texts from the engine called directly, before the server takes the model."""
    model, tokenizer = smollm2
    chat_ids = list(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"])

    async def run():
        async with Engine(model, tokenizer, CONFIG) as engine:
            a = await engine.generate(Request(PROMPT, SamplingParams(max_new_tokens=12)))
            b = await engine.generate(Request(chat_ids, SamplingParams(max_new_tokens=12)))
            shaped = await engine.generate(Request(chat_ids, SamplingParams(max_new_tokens=12, **SHAPED, logprobs=3)))
            return a.text, b.text, shaped

    return anyio.run(run)


@pytest.fixture(scope="module")
def server(smollm2, expected):
    model, tokenizer = smollm2
    metrics = PrometheusMetrics()
    engine = Engine(model, tokenizer, CONFIG, plugins=[metrics])
    app = build_app(engine, "smollm2", metrics, api_key=KEY, max_body_bytes=64 * 1024)
    with serving(app) as url:
        yield url, engine


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


def test_completions_match_the_engine(client, expected):
    out = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.choices[0].text == expected[0]
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens == 5
    pieces = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(pieces)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected[0]
    assert chunks[-1].usage.total_tokens == 17


def test_chat_matches_the_engine(client, expected):
    out = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=12, temperature=0)
    assert out.choices[0].message.content == expected[1]
    stream = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected[1]


def test_stop_strings_and_several_samples(client, expected):
    cut = expected[0].split()[1]  # a word in the middle of the greedy answer
    out = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0, stop=[cut], n=2)
    assert [c.text for c in out.choices] == [expected[0][: expected[0].index(cut)]] * 2
    assert all(c.finish_reason == "stop" for c in out.choices)


def test_streamed_text_stops_before_the_stop_string(client, expected):
    cut = expected[0].split()[1]
    chunks = list(client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0, stop=[cut],
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected[0][: expected[0].index(cut)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_models_health_and_auth(server, client):
    assert [m.id for m in client.models.list()] == ["smollm2"]
    assert client.models.retrieve("smollm2").id == "smollm2"
    with pytest.raises(openai.NotFoundError, match="gpt-9"):
        client.models.retrieve("gpt-9")
    url = server[0]
    assert httpx.get(url + "/v1/models/smollm2").status_code == 401
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server):
    url, engine = server
    start = engine.num_free_blocks
    body = {"model": "smollm2", "prompt": "Tell me a long story.", "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 6:
                break
    deadline = time.time() + 10
    while (engine.requests or engine.num_free_blocks != start) and time.time() < deadline:
        time.sleep(0.05)
    assert not engine.requests
    assert engine.num_free_blocks == start


@pytest.mark.parametrize(
    "path, body, status, words",
    [
        ("/v1/completions", b"{not json", 400, "malformed JSON"),
        ("/v1/completions", b'{"model": "smollm2"}', 400, "prompt"),
        ("/v1/completions", b'{"model": "smollm2", "prompt": ""}', 400, "empty"),
        ("/v1/chat/completions", b'{"model": "smollm2", "messages": []}', 400, "messages"),
        ("/v1/completions", b'{"model": "smollm2", "prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
        ("/v1/completions", b'{"model": "smollm2", "prompt": "hi", "max_tokens": 100000}', 400, "context"),
        ("/v1/completions", b'{"model": "gpt-9", "prompt": "hi"}', 404, "gpt-9"),
        ("/v1/completions", b'{"model": "smollm2", "prompt": "hi", "suffix": "!", "best_of": 3}', 400,
         "best_of, suffix"),
        ("/v1/completions", b'{"model": "smollm2", "prompt": "hi", "echo": true, "logprobs": 1}', 400, "echo"),
        ("/v1/completions", b'{"model": "smollm2", "prompt": "hi", "presence_penalty": 3}', 400, "presence_penalty"),
        ("/v1/completions", b'{"model": "smollm2", "prompt": "hi", "logit_bias": {"x": 1}}', 400, "logit_bias"),
        ("/v1/completions", b'{"model": "smollm2", "prompt": "hi", "logit_bias": {"99999999": 1}}', 400, "logit_bias"),
        ("/v1/chat/completions", b'{"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], '
                                 b'"top_logprobs": 2}', 400, "top_logprobs needs logprobs"),
        ("/v1/completions", b'{"model": "smollm2", "prompt": "hi", "temperature": -1}', 400, "temperature"),
        ("/v1/completions", b'{"model": "smollm2", "prompt": "' + b"x" * 70000 + b'"}', 413, "over"),
    ],
)
def test_bad_input_gets_an_openai_style_4xx_and_the_server_keeps_serving(server, client, expected, path, body, status, words):
    r = httpx.post(server[0] + path, content=body, headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert r.status_code == status
    error = r.json()["error"]
    assert words in error["message"] and error["type"]
    assert client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text == expected[0]


def test_fields_sent_at_their_neutral_values_are_accepted(server, client, expected):
    """SDKs and frameworks send the fields they know at their defaults: those ask for nothing, so they are served
    as if absent (and a prompt as a batch of one, as some send every prompt); the same fields asking for something,
    and a batch of several prompts, are refused by name."""
    neutral = {"tools": [], "tool_choice": "none", "logprobs": False, "presence_penalty": 0, "frequency_penalty": 0.0,
               "logit_bias": {}, "response_format": {"type": "text"}, "parallel_tool_calls": True}
    chat = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": PROMPT}], max_tokens=4,
                                          temperature=0, extra_body={**neutral, "tools": None, "min_p": 0})
    assert chat.choices[0].message.content
    text = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=None,
                                     echo=False, presence_penalty=0, best_of=1)
    assert text.choices[0].text == expected[0]
    assert client.completions.create(model="smollm2", prompt=[PROMPT], max_tokens=12, temperature=0).choices[0].text == expected[0]
    with pytest.raises(openai.BadRequestError, match="a list of 2 prompts: this server takes one prompt a request"):
        client.completions.create(model="smollm2", prompt=[PROMPT, PROMPT], max_tokens=12)
    for field, value in (("echo", True), ("best_of", 2), ("tool_choice", "required"), ("response_format", {"type": "xml"})):
        r = httpx.post(server[0] + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], field: value})
        assert r.status_code == 400 and field in r.json()["error"]["message"], (field, value)


def test_penalties_and_logprobs_are_the_engines(client, expected, smollm2):
    """The sampling controls reach the engine (the text is the library's under the same params), and logprobs come
    back as OpenAI's API shapes them, streamed or not, chat and completions, with the library's values."""
    tokenizer = smollm2[1]
    shaped = expected[2]
    extra = {k: SHAPED[k] for k in ("repetition_penalty", "min_tokens", "top_k")}
    chat = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=12, temperature=0, logprobs=True,
                                          top_logprobs=3, frequency_penalty=1.5, presence_penalty=0.5, extra_body=extra)
    assert chat.choices[0].message.content == shaped.text
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([lp for lp, _ in shaped.samples[0].logprobs], abs=1e-6)
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in shaped.token_ids]
    assert bytes(b for c in content for b in c.bytes).decode() == shaped.text
    for c, (_, top) in zip(content, shaped.samples[0].logprobs):
        assert [t.token for t in c.top_logprobs] == [tokenizer.decode([i]) for i in top]
    pieces = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=12, temperature=0, logprobs=True,
                                            top_logprobs=3, frequency_penalty=1.5, presence_penalty=0.5,
                                            extra_body=extra, stream=True)
    streamed = [c for chunk in pieces for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    plain = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=12, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == expected[1]

    text = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2)
    lp = text.choices[0].logprobs
    assert "".join(lp.tokens) == text.choices[0].text == expected[0]
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == logprob <= 0 and len(top) == 2  # (greedy: the drawn token is the likeliest)
    pieces = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2,
                                       stream=True)
    chunks = [c.choices[0].logprobs for c in pieces if c.choices and c.choices[0].logprobs]
    assert [t for c in chunks for t in c.tokens] == lp.tokens
    assert [o for c in chunks for o in c.text_offset] == lp.text_offset

    favoured = tokenizer.encode(" Lyon", add_special_tokens=False)[0]
    biased = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=3, temperature=0,
                                       logit_bias={str(favoured): 100})
    assert biased.choices[0].text == tokenizer.decode([favoured] * 3)
    only_likeliest = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=3,
                                               extra_body={"min_p": 1.0})
    assert only_likeliest.choices[0].text == expected[0]  # (min_p 1 keeps the likeliest token alone: greedy)


def test_echo_and_continuous_usage(client, expected):
    """echo puts the prompt before the completion, streamed or not; continuous_usage_stats gives every chunk the
    usage so far."""
    echoed = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + expected[0]
    pieces = list(client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0, echo=True,
                                            stream=True, stream_options={"include_usage": True,
                                                                         "continuous_usage_stats": True}))
    assert "".join(c.choices[0].text for c in pieces if c.choices) == PROMPT + expected[0]
    counts = [c.usage.completion_tokens for c in pieces]
    assert counts == sorted(counts) and counts[-1] == 12 and all(c.usage.prompt_tokens == 5 for c in pieces)


def test_structured_output_through_the_openai_client(server, client):
    """response_format json_schema and json_object, and the structured_outputs extra (a choice, a regex): outputs
    match, streamed or not; a schema that cannot compile, or two constraints at once, is a 400 naming the field."""
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 10},
                                               "bright": {"type": "boolean"}}, "required": ["colour", "bright"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "colour", "schema": schema, "strict": True}}
    out = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=100, response_format=fmt)
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    assert out.choices[0].finish_reason == "stop"
    pieces = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=100, temperature=0,
                                            response_format={"type": "json_object"}, stream=True)
    assert isinstance(json.loads("".join(c.choices[0].delta.content or "" for c in pieces if c.choices)), dict)
    pick = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=10,
                                     extra_body={"structured_outputs": {"choice": ["Paris", "Lyon"]}})
    assert pick.choices[0].text in ("Paris", "Lyon")
    code = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=10,
                                          extra_body={"structured_outputs": {"regex": "#[0-9a-f]{6}"}})
    assert re.fullmatch("#[0-9a-f]{6}", code.choices[0].message.content)
    for body, field in (({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "integer", "minimum": "low"}}}}, "response_format"),
                        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
                         "structured_outputs"),
                        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs")):
        r = httpx.post(server[0] + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": "smollm2", "messages": CHAT, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    # a regex of a code point whose lead byte (0xF2) no SmolLM2 token holds: the request's fault, a 400
    r = httpx.post(server[0] + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "smollm2", "messages": CHAT, "structured_outputs": {"regex": "\U0009adad"}})
    assert r.status_code == 400 and "cannot be followed" in r.json()["error"]["message"], r.text


def test_messages_in_the_shapes_openai_clients_send(server, client):
    """Content as an array of text parts reads as its joined text; a tool-call history (an assistant turn with null
    content and tool calls, then the tool's answer) replays; an unknown role or a non-text part is a 400 naming it."""
    def answer(messages):
        return client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=0).choices[0].message.content

    parts = [{"type": "text", "text": "Name a colour"}, {"type": "text", "text": " of the sky."}]
    assert answer([{"role": "user", "content": parts}]) == answer([{"role": "user", "content": "Name a colour of the sky."}])
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    assert answer([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
                   {"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "12 C, rain"}])
    for message, words in (({"role": "wizard", "content": "hi"}, "role"),
                           ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "messages")):
        r = httpx.post(server[0] + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": "smollm2", "messages": [message]})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_metrics_move(server, client):
    def value(name):
        text = httpx.get(server[0] + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        samples = [float(line.split()[-1]) for line in text.splitlines() if line.startswith((name + " ", name + "{"))]
        assert samples, f"{name} is not exported"
        return sum(samples)

    before = value("jitney_generation_tokens_total"), value("jitney_time_to_first_token_seconds_count"), value("jitney_draft_tokens_total")
    client.completions.create(model="smollm2", prompt="Hello", max_tokens=5, temperature=0)
    after = value("jitney_generation_tokens_total"), value("jitney_time_to_first_token_seconds_count"), value("jitney_draft_tokens_total")
    assert after[0] - before[0] == 5 and after[1] - before[1] == 1
    assert after[2] > before[2]  # one greedy request alone: its decode steps speculated
    assert 0 <= value("jitney_draft_accepted_tokens_total") <= after[2]
    for name in ("jitney_inter_token_latency_seconds_count", "jitney_request_latency_seconds_count", "jitney_queue_time_seconds_count",
                 "jitney_requests_running", "jitney_kv_cache_usage_ratio", "jitney_preemptions_total",
                 "jitney_prefix_cache_query_tokens_total"):
        assert value(name) >= 0
    assert value("jitney_prefix_cache_query_tokens_total") > 0


def test_overload_answers_429_at_once(server):
    # A second app over the running engine (no lifespan: the module's server runs it) whose queue bound is 0.
    app = build_app(server[1], "smollm2", PrometheusMetrics(), max_waiting=0)
    r = TestClient(app).post("/v1/completions", json={"model": "smollm2", "prompt": "hi"})
    assert r.status_code == 429
    assert r.json()["error"]["type"] == "rate_limit_exceeded"


def test_online_load_generator_reports_latency_percentiles(server):
    from jitney.bench.online import load

    report = anyio.run(load, server[0], "smollm2", 20.0, 4, 0, KEY)
    assert report["requests"] == 4 and report["output_chunks_per_s"] > 0
    assert 0 < report["ttft_p50_ms"] <= report["ttft_p99_ms"]
    # (speculative steps hand out several tokens at once: many gaps between chunks are ~0)
    assert 0 <= report["itl_p50_ms"] <= report["itl_p99_ms"] and report["itl_p99_ms"] > 0


WEATHER = {"type": "function", "function": {"name": "weather", "description": "The weather in a city now.",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string", "maxLength": 20}},
                                                 "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock", "description": "The time in a time zone.",
                                          "parameters": {"type": "object", "properties": {
                                              "zone": {"type": "string", "maxLength": 20}}, "required": ["zone"]}}}


def test_tool_calls_round_trip_through_a_second_turn(server, client):
    """tool_choice required and named hold the reply to calls whose arguments parse and match; the calls come back
    as OpenAI's `tool_calls` (streamed as one delta), and a history holding them and the tool's answer replays."""
    import json

    import jsonschema

    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    out = client.chat.completions.create(model="smollm2", messages=ask, max_tokens=80, temperature=0,
                                         tools=[WEATHER, CLOCK], tool_choice="required")
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        tool = {"weather": WEATHER, "clock": CLOCK}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    named = client.chat.completions.create(model="smollm2", messages=ask, max_tokens=80, temperature=0,
                                           tools=[WEATHER, CLOCK],
                                           tool_choice={"type": "function", "function": {"name": "clock"}})
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "clock" and "zone" in json.loads(call.function.arguments)
    pieces = list(client.chat.completions.create(model="smollm2", messages=ask, max_tokens=80, temperature=0,
                                                 tools=[WEATHER, CLOCK], tool_choice="required", stream=True))
    streamed = [t for c in pieces if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert [(t.function.name, t.function.arguments) for t in streamed] == [
        (t.function.name, t.function.arguments) for t in choice.message.tool_calls]
    assert pieces[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in pieces if c.choices)  # (the call is not text)
    history = ask + [choice.message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": t.id, "content": "12 C and raining"} for t in choice.message.tool_calls]
    second = client.chat.completions.create(model="smollm2", messages=history, max_tokens=30, temperature=0,
                                            tools=[WEATHER, CLOCK], tool_choice="none")
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls
    free = client.chat.completions.create(model="smollm2", messages=ask, max_tokens=40, temperature=0,
                                          tools=[WEATHER], tool_choice="auto")
    message = free.choices[0].message  # (the model decides: either way the reply is well formed)
    assert (message.tool_calls is None) == (free.choices[0].finish_reason != "tool_calls")
    for body in ({"tool_choice": "required"}, {"tools": [WEATHER], "tool_choice": {"type": "function",
                                                                                  "function": {"name": "nope"}}}):
        r = httpx.post(server[0] + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": "smollm2", "messages": ask, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] in ("tool_choice", "structured_outputs"), r.text


def test_a_streamed_reply_is_held_only_while_it_may_be_a_call():
    from jitney.serve.app import _HeldCalls

    held = _HeldCalls()
    assert held.add(0, " <tool") == "" and held.add(0, "ing is fun") == " <tooling is fun"
    assert held.add(1, '{"name": "a", ') == "" and held.add(1, '"arguments": {}}') == ""
    content, calls = held.end(1)
    assert content is None and calls[0]["function"] == {"name": "a", "arguments": "{}"}
    assert held.add(2, '{"x": 1}') == "" and held.end(2) == ('{"x": 1}', [])  # (JSON, but no call: text at the end)
    assert held.add(3, "Hello") == "Hello" and held.add(3, " <tool_call>") == " <tool_call>"
    assert held.end(3) == (None, [])
