"""The server when things go wrong: engine failures, shutdown, a dead step loop, hostile input, clients that
leave; its OpenAPI document, and a schemathesis fuzz against it.

A tiny random Llama that speaks SmolLM2's tokenizer keeps every step cheap (its text is gibberish, which is
all these tests need); a stand-in for the engine's forward makes steps fail, wait or crawl on demand.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import anyio
import httpx
import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance, negative_data_rejection, response_schema_conformance, status_code_conformance,
)
from starlette.testclient import TestClient
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from support import serving

from jitney import Engine, EngineConfig
from jitney.core.models import embedded_checkpoint
from jitney.plugins.metrics import PrometheusMetrics
from jitney.serve.app import build_app

KEY = "fault-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT = 512
BODY_LIMIT = 128 * 1024
MAX_WAITING = 32
MARK = 4242  # a prompt holding this token id makes its step fail


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(embedded_checkpoint())


def tiny_model(vocab_size: int) -> LlamaForCausalLM:
    """A fresh tiny model: an engine binds the model object it runs, so each engine gets its own."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=CONTEXT, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


class Faults:
    """Stands in for the engine's forward: fails a step that runs `MARK` or the `fail_in`-th step from now,
    holds steps at a gate while it is shut, and sleeps `delay` seconds a step."""

    def __init__(self, engine: Engine):
        self.forward = engine.executor.forward
        self.gate = threading.Event()
        self.gate.set()
        self.delay = 0.0
        self.fail_in: int | None = None
        engine.executor.forward = self

    def __call__(self, prepared, started):
        assert self.gate.wait(60), "the test never opened the gate"
        time.sleep(self.delay)
        if self.fail_in is not None:
            self.fail_in -= 1
            if self.fail_in == 0:
                self.fail_in = None
                raise RuntimeError("injected fault")
        if prepared.input_ids is not None and bool((prepared.input_ids == MARK).any()):
            raise RuntimeError("injected fault")
        return self.forward(prepared, started)

    def reset(self) -> None:
        self.gate.set()
        self.delay, self.fail_in = 0.0, None


@pytest.fixture(scope="module")
def server(tokenizer):
    """(url, engine, faults): the server the fault tests share."""
    engine = Engine(tiny_model(len(tokenizer)), tokenizer, EngineConfig(num_blocks=128, max_batch_tokens=128))
    faults = Faults(engine)
    app = build_app(engine, "tiny", PrometheusMetrics(), api_key=KEY, max_body_bytes=BODY_LIMIT,
                    max_waiting=MAX_WAITING)
    with serving(app) as url:
        yield url, engine, faults


@pytest.fixture
def faults(server):
    yield server[2]
    server[2].reset()


def post(url: str, body: dict, path: str = "/v1/completions", timeout=60) -> httpx.Response:
    return httpx.post(url + path, json={"model": "tiny", **body}, headers=AUTH, timeout=timeout)


def events(response: httpx.Response) -> list:
    """A stream's events: each parsed from JSON, but the closing "[DONE]" as it is."""
    data = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


def until(condition, seconds: float = 10) -> None:
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


# -- engine failures -----------------------------------------------------------------------------------------


def test_an_engine_failure_is_a_500_error_object_and_the_server_goes_on(server, faults):
    url = server[0]
    r = post(url, {"prompt": [1, MARK, 2], "max_tokens": 4})
    assert r.status_code == 500
    error = r.json()["error"]
    assert "injected fault" in error["message"] and error["type"] == "server_error"
    assert set(error) == {"message", "type", "param", "code"}
    faults.fail_in = 1  # the chat's first step
    r = post(url, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, "/v1/chat/completions")
    assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
    ok = post(url, {"prompt": "Once upon a time", "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 40}),
])
def test_a_stream_that_fails_ends_with_an_error_event_then_done(server, faults, path, body):
    faults.fail_in = 3  # after two steps have streamed their tokens
    r = post(server[0], {**body, "stream": True}, path)
    assert r.status_code == 200
    *chunks, error, done = events(r)
    assert done == "[DONE]"
    assert "injected fault" in error["error"]["message"]
    assert chunks and all("error" not in c for c in chunks)
    assert any(choice.get("text") or choice.get("delta", {}).get("content") for c in chunks for choice in c["choices"])
    assert all(choice["finish_reason"] is None for c in chunks for choice in c["choices"])  # never "stop"


async def test_requests_cancelled_by_shutdown_are_answered_503(tokenizer):
    engine = Engine(tiny_model(len(tokenizer)), tokenizer, EngineConfig(num_blocks=64))
    faults = Faults(engine)
    faults.gate.clear()  # their first step waits until the server is shutting down
    app = build_app(engine, "tiny", PrometheusMetrics())
    answers = {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://jitney") as client:

        async def ask(name: str, stream: bool) -> None:
            body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8, "stream": stream}
            answers[name] = await client.post("/v1/completions", json=body, timeout=60)

        async with anyio.create_task_group() as tg:
            async with app.router.lifespan_context(app):
                tg.start_soon(ask, "plain", False)
                tg.start_soon(ask, "stream", True)
                with anyio.fail_after(10):
                    while len(engine.requests) < 2:
                        await anyio.sleep(0.01)
                faults.gate.set()  # (the engine's exit waits for the step under way; it aborts both first)
    plain, stream = answers["plain"], answers["stream"]
    assert plain.status_code == 503
    assert "shutting down" in plain.json()["error"]["message"]
    *_, error, done = events(stream)
    assert done == "[DONE]" and "shutting down" in error["error"]["message"]


def test_health_is_503_while_the_step_loop_does_not_run(tokenizer):
    engine = Engine(tiny_model(len(tokenizer)), tokenizer, EngineConfig(num_blocks=16))
    client = TestClient(build_app(engine, "tiny", PrometheusMetrics()))
    before = client.get("/health")
    assert before.status_code == 503 and "not running" in before.json()["error"]["message"]
    with client:
        assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/health").status_code == 503


# -- input edges -------------------------------------------------------------------------------------------


def test_an_authorization_header_that_is_not_utf8_is_a_401(server):
    r = httpx.get(server[0] + "/v1/models", headers={"Authorization": b"Bearer \xff\xfe"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server[0] + "/v1/models", headers=AUTH).status_code == 200


def test_a_chunked_body_over_the_limit_is_refused_while_it_is_still_coming(server):
    host, port = server[0].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                  "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        piece = b"x" * 4096
        for _ in range(BODY_LIMIT // len(piece) + 2):
            s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        # the body has not ended (no last chunk is ever sent): the answer comes all the same
        answer = s.recv(65536)
        head, _, body = answer.partition(b"\r\n\r\n")
        length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")).split(b":")[1])
        while len(body) < length:
            body += s.recv(65536)
    assert head.startswith(b"HTTP/1.1 413")
    assert "over" in json.loads(body)["error"]["message"]


def test_a_body_nested_too_deeply_is_a_400(server):
    r = httpx.post(server[0] + "/v1/completions", content=b"[" * 50_000 + b"]" * 50_000, headers=AUTH)
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"]


def test_n_has_an_upper_bound(server):
    r = post(server[0], {"prompt": "Hi", "max_tokens": 2, "n": 17})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = post(server[0], {"prompt": "Hi", "max_tokens": 2, "n": 16})
    assert r.status_code == 200 and len(r.json()["choices"]) == 16


def test_samples_count_against_max_waiting(server, faults):
    url, engine, _ = server
    faults.gate.clear()  # the first request's step holds the engine: the next ones wait
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(post, url, {"prompt": "A", "max_tokens": 1})
        until(lambda: engine.requests and not engine.waiting)
        queued = [pool.submit(post, url, {"prompt": p, "max_tokens": 1, "n": 16}) for p in ("B", "C")]
        until(lambda: len(engine.waiting) == 2)  # 32 samples waiting: the queue is full
        over = post(url, {"prompt": "D", "max_tokens": 1})
        faults.gate.set()
        assert over.status_code == 429 and over.json()["error"]["type"] == "rate_limit_exceeded"
        assert first.result().status_code == 200
        assert [len(f.result().json()["choices"]) for f in queued] == [16, 16]


@pytest.fixture
def spy_encode(tokenizer, monkeypatch):
    """Record the tokenizer's encode calls; `slow` (seconds) makes each one take that long."""
    calls, original = [], tokenizer.encode
    state = {"slow": 0.0, "entered": threading.Event(), "left": threading.Event()}

    def encode(*args, **kwargs):
        calls.append(args)
        state["entered"].set()
        time.sleep(state["slow"])
        state["left"].set()
        return original(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", encode)
    return calls, state


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(server, tokenizer, spy_encode):
    calls, _ = spy_encode
    most_bytes = max(len(t.encode()) for t in tokenizer.get_vocab()) * CONTEXT
    assert most_bytes < BODY_LIMIT - 100  # (else the body limit would refuse it first)
    r = post(server[0], {"prompt": "a" * (most_bytes + 1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "context" in r.json()["error"]["message"]
    assert calls == []
    r = post(server[0], {"messages": [{"role": "user", "content": "a" * (most_bytes + 1)}]}, "/v1/chat/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_tokenizing_leaves_the_server_responsive(server, spy_encode):
    calls, state = spy_encode
    state["slow"] = 2.0
    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(post, server[0], {"prompt": "Hello", "max_tokens": 1})
        assert state["entered"].wait(10)
        assert httpx.get(server[0] + "/health", timeout=10).status_code == 200
        assert not state["left"].is_set()  # /health answered while the prompt was still being tokenized
        assert done.result().status_code == 200


def test_a_non_streaming_client_that_disconnects_aborts_its_request(server, faults):
    url, engine, _ = server
    start = engine.num_free_blocks
    faults.delay = 0.03  # 400 tokens: over 12 s if nobody stops it
    with pytest.raises(httpx.ReadTimeout):
        post(url, {"prompt": "Tell me a long story.", "max_tokens": 400, "temperature": 1.0, "seed": 1},
             timeout=httpx.Timeout(10, read=1.0))
    deadline = time.time() + 5
    while (engine.requests or engine.num_free_blocks != start) and time.time() < deadline:
        time.sleep(0.05)
    assert not engine.requests
    assert engine.num_free_blocks == start


# -- the OpenAPI document and a fuzz against it -------------------------------------------------------------


def test_openapi_describes_the_endpoints_and_the_servers_limits(server):
    doc = httpx.get(server[0] + "/openapi.json").json()  # (public, like /health)
    assert doc["openapi"].startswith("3.")
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= set(doc["paths"])
    assert doc["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
    assert doc["security"] == [{"bearer": []}]
    body = doc["components"]["schemas"]["CompletionBody"]["properties"]
    assert body["n"]["maximum"] == 16  # build_app's max_n
    assert {"Completion", "ChatCompletion", "ModelList", "ErrorBody", "Health"} <= set(doc["components"]["schemas"])


def _fuzz_app():
    """An app of its own for the fuzz, with a small cache and small limits; made when the module loads, since
    schemathesis reads the schema it parametrizes the fuzz with then (its engine starts with the server)."""
    tokenizer = AutoTokenizer.from_pretrained(embedded_checkpoint())
    engine = Engine(tiny_model(len(tokenizer)), tokenizer, EngineConfig(num_blocks=64, max_batch_tokens=128))
    return build_app(engine, "tiny", PrometheusMetrics(), api_key=KEY, max_n=2, max_tokens=8)


FUZZ_APP = _fuzz_app()
FUZZ_CONFIG = {"phases": {"stateful": {"enabled": False}}, "generation": {"max-examples": 25, "mode": "all"}}
# the document the app publishes, as any client would fetch it
fuzz_schema = schemathesis.openapi.from_dict(TestClient(FUZZ_APP).get("/openapi.json").json(),
                                             config=schemathesis.Config.from_dict(FUZZ_CONFIG))


@pytest.fixture(scope="module")
def fuzz_url():
    with serving(FUZZ_APP) as url:
        yield url


@fuzz_schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_fuzz_the_api(case, fuzz_url):
    case.call_and_validate(base_url=fuzz_url, headers=AUTH, timeout=60, checks=[
        not_a_server_error, response_schema_conformance, status_code_conformance, content_type_conformance,
        negative_data_rejection])


def test_user_and_metadata_reach_the_engine_as_request_metadata(server, monkeypatch):
    url, engine, _ = server
    seen = []
    submit = engine.submit
    monkeypatch.setattr(engine, "submit", lambda req: seen.append(req.metadata) or submit(req))
    answer = post(url, {"prompt": "Hello", "max_tokens": 2, "user": "u1", "metadata": {"tenant": "a"}})
    assert answer.status_code == 200, answer.text
    assert seen == [{"tenant": "a", "user": "u1"}]
    assert post(url, {"prompt": "Hello", "max_tokens": 2, "metadata": {"tenant": 3}}).status_code == 400
