"""Structured logs: JSON lines off a terminal, one summary line per request carrying its id."""

from __future__ import annotations

import json

import structlog
from support import random_requests

from jitney import Engine, EngineConfig, Request, SamplingParams
from jitney.plugins.logs import RequestLog, configure_logging


async def test_one_json_summary_line_per_request(llama, capsys):
    configure_logging(json=True)
    try:
        work = random_requests(3, llama.config.vocab_size, max_prompt=10, max_new=4, seed=2)
        async with Engine(llama, config=EngineConfig(num_blocks=32), plugins=[RequestLog()]) as engine:
            ids = [(await engine.generate(Request(p, SamplingParams(max_new_tokens=n)))).request_id for p, n in work]
        lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    finally:
        structlog.reset_defaults()
    summaries = [line for line in lines if line["event"] == "request finished"]
    assert [s["request_id"] for s in summaries] == ids
    assert [s["output_tokens"] for s in summaries] == [n for _, n in work]
    assert all(s["level"] == "info" and s["finish_reason"] == "length" and "timestamp" in s for s in summaries)
