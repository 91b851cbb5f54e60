"""A soak of `jitney serve` in its own process: 200 streaming clients for a bounded time, a third leaving
mid-stream; afterwards nothing runs, the KV cache is back at its baseline and resident memory within 10%."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import anyio
import httpx

from jitney.bench.soak import soak


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_200_clients_a_third_leaving_leave_the_server_where_it_started(smollm2, tmp_path):
    port = free_port()
    log = (tmp_path / "server.log").open("w")  # (a pipe nobody reads would fill with its request log and stall it)
    server = subprocess.Popen(
        [sys.executable, "-m", "jitney.cli", "serve", "--port", str(port), "--num-blocks", "512",
         "--max-waiting", "1000", "--max-batch-tokens", "256"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        # a warm-up round first: the first requests allocate what every later one reuses
        anyio.run(soak, url, "smollm2", 32, 3.0, 1 / 3, 16, 1, None, server.pid)
        result = anyio.run(soak, url, "smollm2", 200, 20.0, 1 / 3, 32, 2, None, server.pid)
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
    before, after = result["before"], result["after"]
    assert result["left"] >= result["requests"] // 5, result  # many clients left mid-stream
    assert result["completed"] > 0 and result["server_errors"] == 0 and result["error_events"] == 0, result
    assert after["running"] == 0 and after["waiting"] == 0, result
    assert after["kv_usage"] <= before["kv_usage"], result
    assert after["rss_mb"] <= 1.10 * before["rss_mb"], result
    print(result)
