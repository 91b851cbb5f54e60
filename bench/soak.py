"""`jitney soak`: many streaming clients against a server for a while, some leaving mid-stream; then whether the
server came back to where it started (no request running, KV cache usage at its baseline, resident memory)."""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import anyio
import httpx

from jitney.bench.workloads import sharegpt_like


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--clients", type=int, default=200, help="concurrent streaming clients")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--leave", type=float, default=1 / 3, help="share of requests whose client disconnects mid-stream")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--pid", type=int, default=None, help="the server's process id, to compare its resident memory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--json", dest="json_path", default=None)


def metric(text: str, name: str) -> float:
    """A gauge's value from Prometheus' text format (the first series of that name)."""
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def rss_bytes(pid: int) -> int:
    """Resident memory of process `pid` (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise KeyError("VmRSS")


async def server_state(client: httpx.AsyncClient, url: str, headers: dict, pid: int | None) -> dict:
    text = (await client.get(f"{url}/metrics", headers=headers)).text
    state = {"running": metric(text, "jitney_requests_running"), "waiting": metric(text, "jitney_requests_waiting"),
             "kv_usage": metric(text, "jitney_kv_cache_usage_ratio")}
    if pid is not None:
        state["rss_mb"] = rss_bytes(pid) / 2**20
    return state


async def settle(client: httpx.AsyncClient, url: str, headers: dict, pid: int | None, timeout_s: float = 60) -> dict:
    """The server's state once nothing runs or waits (or as it is after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = await server_state(client, url, headers, pid)
        if (state["running"] == 0 and state["waiting"] == 0) or time.monotonic() > deadline:
            return state
        await anyio.sleep(0.2)


async def soak(url: str, model: str, clients: int, duration_s: float, leave: float, max_tokens: int,
               seed: int, api_key: str | None, pid: int | None) -> dict:
    """Run the load; return what clients saw and the server's state before and after."""
    rng = random.Random(seed)
    prompts = [p[:128] for p, _ in sharegpt_like(10_000)]  # token ids below 10,000 exist in any common vocabulary
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    counts = {"requests": 0, "completed": 0, "left": 0, "refused": 0, "server_errors": 0, "error_events": 0}
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120), limits=limits) as client:
        await settle(client, url, headers, pid)
        before = await server_state(client, url, headers, pid)
        stop_at = time.monotonic() + duration_s

        async def one_client() -> None:
            while time.monotonic() < stop_at:
                body = {"model": model, "prompt": rng.choice(prompts), "max_tokens": rng.randint(4, max_tokens),
                        "temperature": 0, "stream": True}
                leave_after = rng.randint(0, 8) if rng.random() < leave else None
                counts["requests"] += 1
                async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
                    if response.status_code >= 500:
                        counts["server_errors"] += 1
                        continue
                    if response.status_code != 200:  # 429 at capacity
                        counts["refused"] += 1
                        await anyio.sleep(0.05)
                        continue
                    chunks = 0
                    async for line in response.aiter_lines():
                        if line.startswith('data: {"error"'):
                            counts["error_events"] += 1
                        if line.startswith("data: "):
                            chunks += 1
                        if leave_after is not None and chunks > leave_after:
                            break  # leaving the block closes the connection mid-stream
                    counts["left" if leave_after is not None and chunks > leave_after else "completed"] += 1

        async with anyio.create_task_group() as tg:
            for _ in range(clients):
                tg.start_soon(one_client)
        after = await settle(client, url, headers, pid)
    return {"clients": clients, "duration_s": duration_s, **counts, "before": before, "after": after}


def main(args: argparse.Namespace) -> int:
    result = anyio.run(soak, args.url.rstrip("/"), args.model, args.clients, args.duration, args.leave, args.max_tokens,
                       args.seed, args.api_key, args.pid)
    print(json.dumps(result, indent=2))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    after, before = result["after"], result["before"]
    drift = after.get("rss_mb", 0) / before["rss_mb"] - 1 if "rss_mb" in before else 0.0
    ok = after["running"] == 0 and after["kv_usage"] <= before["kv_usage"] and result["server_errors"] == 0 and drift <= 0.10
    print(f"rss drift {drift:+.1%}; {'ok' if ok else 'NOT BACK TO BASELINE'}")
    return 0 if ok else 1
