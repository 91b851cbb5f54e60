"""`jitney serve --replicas N` on a local Ray: two SmolLM2 replicas behind Ray Serve answer the real OpenAI
client with a single engine's tokens, routers place requests as they say, each replica's metrics are labelled,
and a replica killed mid-run loses no request that had not started streaming."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
import httpx
import pytest
import ray
from ray import serve

from jitney import Engine, EngineConfig, Request, SamplingParams
from jitney.serve.cluster import REPLICA_HEADER, Fleet, application

PACK_ROUTER = Path(__file__).resolve().parent.parent / "examples" / "pack_router"
ENGINE = {"num_blocks": 160, "max_batch_tokens": 128}
PROMPTS = [[1, 9690, 2114, 253, 1012, 28, 665, 436, 253, 1165], [1, 2, 3, 4, 5, 6, 7, 8], [4000 + i for i in range(40)]]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A local Ray with Serve on a free port; the example router package installed where Ray's workers (and
    this process) find it."""
    site = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target",
                    str(site), str(PACK_ROUTER)], check=True, capture_output=True, timeout=300)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(site))
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
        ray.init(include_dashboard=False, log_to_driver=False)  # (its workers inherit PYTHONPATH)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
        serve.shutdown()
        ray.shutdown()


def deploy(url: str, router: str, replicas: int = 2) -> str:
    """(Re)deploy the fleet; return once the gateway's router knows every replica (a fresh gateway may first
    see only the replica that started first)."""
    serve.run(application(Fleet("smollm2", replicas, router, dict(ENGINE), max_waiting=64)), name="jitney",
              route_prefix="/")
    deadline = time.monotonic() + 60
    while len(labelled_replicas(url)) < replicas:
        assert time.monotonic() < deadline, "the gateway never saw every replica"
        time.sleep(0.2)
    return url


def labelled_replicas(url: str) -> set[str]:
    """The replicas whose series /metrics shows (gathered through the gateway's handle, as requests are)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {line.split('replica="')[1].split('"')[0] for line in text.splitlines() if 'replica="' in line}


def complete(url: str, prompt: list[int], max_tokens: int = 12) -> httpx.Response:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    return response


@pytest.fixture(scope="module")
def single_engine_texts() -> list[str]:
    async def main():
        async with Engine.from_pretrained("smollm2", config=EngineConfig(**ENGINE)) as engine:
            return [(await engine.generate(Request(p, SamplingParams(max_new_tokens=12)))).text for p in PROMPTS]

    return anyio.run(main)


def test_two_replicas_answer_the_openai_client_with_a_single_engines_tokens(cluster, single_engine_texts):
    import openai

    url = deploy(cluster, "prefix_affinity")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    for prompt, expected in zip(PROMPTS, single_engine_texts):
        raw = client.completions.with_raw_response.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0)
        assert raw.parse().choices[0].text == expected
        assert raw.headers[REPLICA_HEADER]
    chat = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                          temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices)  # streamed through the gateway
    assert len(labelled_replicas(url)) == 2  # each replica's series, labelled
    assert httpx.get(f"{url}/health", timeout=30).json() == {"status": "ok"}


def test_a_shared_prefix_stays_on_one_replica_under_prefix_affinity_and_spreads_under_round_robin(cluster):
    system = [3000 + i for i in range(64)]
    asks = [system + [100 + i, 200 + i] for i in range(6)]
    url = deploy(cluster, "prefix_affinity")
    assert len({complete(url, p, 2).headers[REPLICA_HEADER] for p in asks}) == 1
    url = deploy(cluster, "round_robin")
    assert len({complete(url, p, 2).headers[REPLICA_HEADER] for p in asks}) == 2


def test_a_router_installed_as_a_package_places_the_requests(cluster):
    url = deploy(cluster, "pack")  # (examples/pack_router: fill the first replica up to 8 requests)
    asks = [[6000 + 13 * i + j for j in range(20)] for i in range(6)]

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            placed = []

            async def one(prompt):
                body = {"model": "smollm2", "prompt": prompt, "max_tokens": 16, "temperature": 0}
                placed.append((await client.post(f"{url}/v1/completions", json=body)).headers[REPLICA_HEADER])

            async with anyio.create_task_group() as tg:
                for prompt in asks:
                    tg.start_soon(one, prompt)
            return placed

    placed = anyio.run(main)
    assert len(placed) == 6 and len(set(placed)) == 1  # sent at once, yet all on the first replica


async def _stream(client: httpx.AsyncClient, url: str, prompt: list[int], seen: dict) -> None:
    """One streaming request; `seen` gets its replica, its tokens so far and how it ended."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 40, "temperature": 0, "stream": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        seen["status"] = response.status_code
        seen["replica"] = response.headers.get(REPLICA_HEADER)
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                seen["end"] = "error"
            elif event["choices"] and event["choices"][0]["finish_reason"]:
                seen["end"] = event["choices"][0]["finish_reason"]
            elif event["choices"] and event["choices"][0]["text"]:
                seen["tokens"] = seen.get("tokens", 0) + 1


def test_a_replica_killed_mid_run_loses_no_request_that_had_not_started_streaming(cluster):
    url = deploy(cluster, "least_loaded")
    # (enough that the victim cannot have started them all between the snapshot below and its death)
    prompts = [[5000 + 7 * i + j for j in range(30 + i)] for i in range(20)]
    seen = [{} for _ in prompts]
    killed: dict = {}

    async def main():
        async with httpx.AsyncClient(timeout=180) as client, anyio.create_task_group() as tg:
            for prompt, s in zip(prompts, seen):
                tg.start_soon(_stream, client, url, prompt, s)
            with anyio.fail_after(120):
                while sum(1 for s in seen if s.get("tokens")) < 2:
                    await anyio.sleep(0.05)
            killed["victim"] = victim = next(s["replica"] for s in seen if s.get("tokens"))
            killed["waiting"] = [i for i, s in enumerate(seen) if not s.get("tokens")]
            ray.kill(_replica_actor(victim), no_restart=True)

    anyio.run(main)
    assert killed["waiting"]  # (some had not started when the replica died)
    for i, s in enumerate(seen):
        assert s["end"] in ("length", "stop", "error"), s  # every stream ended: none hangs
        if s["end"] == "error":  # only those cut off mid-stream: tokens already streamed from the killed replica
            assert s["replica"] == killed["victim"] and s.get("tokens"), s  # (some sent after the snapshot above,
            # before the kill took effect)
    # those waiting were placed again on the other replica and served in full (but for any whose first token was
    # already on its way from the killed one)
    served = [i for i in killed["waiting"] if seen[i]["end"] in ("length", "stop")]
    assert served and all(seen[i]["replica"] == killed["victim"] for i in set(killed["waiting"]) - set(served))
    time.sleep(1)
    assert complete(url, PROMPTS[0]).status_code == 200  # the deployment answers afterwards


def _replica_actor(replica_id: str):
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if "EngineReplica" in actor["name"] and replica_id in actor["name"]:
            return ray.get_actor(actor["name"], namespace=actor["namespace"])
    raise LookupError(f"no actor for replica {replica_id}")


def test_draining_answers_new_requests_503_and_lets_running_ones_finish(cluster):
    url = deploy(cluster, "least_loaded")
    seen: dict = {}

    async def main():
        async with httpx.AsyncClient(timeout=120) as client, anyio.create_task_group() as tg:
            tg.start_soon(_stream, client, url, [7000 + j for j in range(20)], seen)
            with anyio.fail_after(60):
                while not seen.get("tokens"):
                    await anyio.sleep(0.05)
            drained = serve.get_app_handle("jitney").drain.remote(60)  # (what SIGTERM does first)
            await anyio.sleep(0.5)
            late = await client.post(f"{url}/v1/completions", json={"model": "smollm2", "prompt": [5, 6], "max_tokens": 2})
            assert late.status_code == 503
            assert (await client.get(f"{url}/health")).status_code == 503
            assert await anyio.to_thread.run_sync(drained.result) == 0  # nothing was left running

    anyio.run(main)
    assert seen["end"] == "length"  # the running request ran to its max_tokens
