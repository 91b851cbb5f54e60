"""`jitney bench-online`: Poisson arrivals of streaming clients against a server, serving-benchmark figures."""

from __future__ import annotations

import argparse
import json
import random
import socket
import threading
import time
from collections import Counter

import anyio
import httpx

from jitney.bench.run import print_report
from jitney.bench.workloads import WORKLOADS
from jitney.serve.cluster import REPLICA_HEADER


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help="a running server; default: start one in-process on loopback")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rate", type=float, default=1.0, help="mean request arrivals per second (Poisson)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--workload", default="sharegpt-like", choices=[k for k in WORKLOADS if "chat" not in k],
                        help="the requests' shapes (repeated up to --requests)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--json", dest="json_path", default=None)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def _client(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], n: int, headers: dict) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
    start = time.perf_counter()
    stamps: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0]["text"]:
                    stamps.append(time.perf_counter())
    return {"start": start, "stamps": stamps, "end": time.perf_counter(), "replica": response.headers.get(REPLICA_HEADER)}


async def prefix_counts(client: httpx.AsyncClient, url: str, headers: dict) -> tuple[float, float]:
    """Prompt tokens looked up in the prefix cache and found there, summed over the server's /metrics (every
    replica's, for a fleet)."""
    text = (await client.get(f"{url}/metrics", headers=headers)).text
    sums = {"jitney_prefix_cache_query_tokens_total": 0.0, "jitney_prefix_cache_hit_tokens_total": 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            sums[name] += float(line.rsplit(" ", 1)[1])
    return sums["jitney_prefix_cache_query_tokens_total"], sums["jitney_prefix_cache_hit_tokens_total"]


async def load(url: str, model: str, rate: float, count: int, seed: int, api_key: str | None,
               workload: str = "sharegpt-like") -> dict:
    """Send `count` streaming requests of `workload` with exponential gaps of mean 1/rate; summarise what
    clients saw, the prefix cache's hits over the run, and how the requests spread over replicas."""
    rng = random.Random(seed)
    mix = WORKLOADS[workload](10_000)  # token ids below 10,000 exist in any common vocabulary
    work = [mix[i % len(mix)] for i in range(count)]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    results: list[dict] = []
    async with httpx.AsyncClient(timeout=None) as client:
        queried, hit = await prefix_counts(client, url, headers)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=None) as client, anyio.create_task_group() as tg:
        async def one(prompt, n):
            results.append(await _client(client, url, model, prompt, n, headers))

        for prompt, n in work:
            tg.start_soon(one, prompt, n)
            await anyio.sleep(rng.expovariate(rate))
    wall = time.perf_counter() - t0
    async with httpx.AsyncClient(timeout=None) as client:
        queried_after, hit_after = await prefix_counts(client, url, headers)
    spread = Counter(r["replica"] for r in results if r["replica"])
    ttft = [r["stamps"][0] - r["start"] for r in results if r["stamps"]]
    itl = [b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:])]
    tpot = [(r["stamps"][-1] - r["stamps"][0]) / (len(r["stamps"]) - 1) for r in results if len(r["stamps"]) > 1]
    chunks = sum(len(r["stamps"]) for r in results)
    return {
        "rate": rate, "requests": count, "wall_s": round(wall, 2), "output_chunks_per_s": round(chunks / wall, 1),
        "requests_per_s": round(count / wall, 3),
        "prefix_hit_rate": round((hit_after - hit) / max(1.0, queried_after - queried), 3),
        "prompt_tokens_from_cache": int(hit_after - hit),
        **({"requests_per_replica": sorted(spread.values(), reverse=True)} if spread else {}),
        **{f"{name}_{tag}_ms": round(1000 * percentile(vals, q), 1)
           for name, vals in (("ttft", ttft), ("tpot", tpot), ("itl", itl)) for tag, q in (("p50", 0.5), ("p99", 0.99))},
    }


def _start_server(model: str) -> tuple[str, str, object]:
    """Serve `model` on a free loopback port in a background thread; (url, served name, server)."""
    from pathlib import Path

    import uvicorn

    from jitney.core.engine import Engine
    from jitney.plugins.metrics import PrometheusMetrics
    from jitney.serve.app import build_app

    metrics = PrometheusMetrics()
    name = model if model == "smollm2" else Path(model).name
    app = build_app(Engine.from_pretrained(model, plugins=[metrics]), name, metrics)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.1)
    return f"http://127.0.0.1:{port}", name, server


def main(args) -> int:
    url, model, server = (args.url, args.model, None) if args.url else _start_server(args.model)
    try:
        report = anyio.run(load, url.rstrip("/"), model, args.rate, args.requests, args.seed, args.api_key,
                           args.workload)
    finally:
        if server is not None:
            server.should_exit = True
    return print_report(report, args.json_path)
