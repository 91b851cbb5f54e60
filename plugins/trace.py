"""Recording served traffic as a request trace (`jitney serve --record-trace`), to replay it later with
`jitney simulate --trace` or `jitney bench --trace` (the format: `jitney/bench/traces.py`)."""

from __future__ import annotations

from pathlib import Path

import msgspec

from jitney.core import events as ev
from jitney.core.hooks import hookimpl


class TraceRecorder:
    """An observer: one JSONL line per finished request — its arrival (seconds from the first), its prompt ids,
    the tokens it generated, its priority. Further samples of an ``n > 1`` request are not lines of their own."""

    def __init__(self, path: str | Path):
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
                    line = {"arrival_s": round(t - self.t0, 4), "prompt_ids": prompt, "output_tokens": e.output_tokens}
                    if priority:
                        line["priority"] = priority
                    self.file.write(self.encode(line) + b"\n")
                    wrote = True
        if wrote:
            self.file.flush()

    @hookimpl
    def jitney_engine_stopped(self, engine):
        self.file.close()
