"""Recording served traffic as a request trace (`jitney serve --record-trace`), to replay it later with
`jitney simulate --trace` or `jitney bench --trace` (the format: `jitney/bench/traces.py`)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec

from jitney.core import events as ev
from jitney.core.hooks import hookimpl


def block_hashes(prompt: list[int], block: int = 16) -> list[str]:
    """Chained hashes of a prompt's full blocks (each over its whole prefix): equal for equal prefixes, and no
    token can be read back from them."""
    out, prev = [], b""
    for i in range(len(prompt) // block):
        prev = hashlib.sha256(prev + repr(prompt[i * block : (i + 1) * block]).encode()).digest()
        out.append(prev.hex()[:16])
    return out


class TraceRecorder:
    """An observer: one JSONL line per finished request — its arrival (seconds from the first), its prompt (its
    token ids with `token_ids`; else only its length and its blocks' chained hashes, which keep prefix sharing
    and none of the text), the tokens it generated, its priority. Further samples of an ``n > 1`` request are
    not lines of their own."""

    def __init__(self, path: str | Path, token_ids: bool = False):
        self.token_ids = token_ids
        self.file = open(path, "ab")  # (appended: a restarted server adds to the trace it was recording)
        self.encode = msgspec.json.Encoder().encode
        self.t0: float | None = None
        self._queued: dict[str, tuple[float, list[int], int]] = {}

    @hookimpl
    def jitney_on_events(self, events, engine):
        wrote = False
        for e in events:
            if isinstance(e, ev.RequestQueued):
                collector = engine.requests.get(e.request_id)
                if collector is not None:
                    first = collector.samples[0]
                    self._queued[e.request_id] = (e.t, list(first.prompt_ids), first.request.priority)
                    self.t0 = e.t if self.t0 is None else self.t0
            elif isinstance(e, ev.RequestFinished):
                queued = self._queued.pop(e.request_id, None)
                if queued is not None and e.output_tokens > 0:
                    t, prompt, priority = queued
                    line: dict = {"arrival_s": round(t - self.t0, 4), "output_tokens": e.output_tokens}
                    if self.token_ids:
                        line["prompt_ids"] = prompt
                    else:
                        line |= {"prompt_tokens": len(prompt), "prefix_hashes": block_hashes(prompt)}
                    if priority:
                        line["priority"] = priority
                    self.file.write(self.encode(line) + b"\n")
                    wrote = True
        if wrote:
            self.file.flush()

    @hookimpl
    def jitney_engine_stopped(self, engine):
        self.file.close()
