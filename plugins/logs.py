"""Structured logs through structlog: JSON lines off a terminal, readable console output on one."""

from __future__ import annotations

import sys

import structlog

from jitney.core import events as ev
from jitney.core.hooks import hookimpl


def configure_logging(json: bool | None = None) -> None:
    """JSON lines when stderr is not a terminal (or `json=True`), coloured key=value lines when it is."""
    if json is None:
        json = not sys.stderr.isatty()
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso"), renderer],
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


class RequestLog:
    """An observer plugin: one summary line per finished request, and a line per failure, each with its id."""

    def __init__(self, logger=None):
        self.log = logger or structlog.get_logger("jitney")
        self._ttft: dict[str, float] = {}
        self._cached: dict[str, int] = {}

    @hookimpl
    def jitney_on_events(self, events, engine):
        for e in events:
            if isinstance(e, ev.FirstToken):
                self._ttft[e.request_id] = e.ttft
            elif isinstance(e, ev.PrefillStarted):
                self._cached[e.request_id] = self._cached.get(e.request_id, 0) + e.cached_tokens
            elif isinstance(e, ev.RequestFailed):
                self.log.error("request failed", request_id=e.request_id, error=e.error)
            elif isinstance(e, (ev.RequestOffloaded, ev.RequestSoftReset)):
                self.log.info("request preempted", request_id=e.request_id, how=type(e).__name__)
            elif isinstance(e, ev.RequestFinished):
                ttft = self._ttft.pop(e.request_id, None)
                self.log.info(
                    "request finished", request_id=e.request_id, finish_reason=e.finish_reason,
                    prompt_tokens=e.prompt_tokens, output_tokens=e.output_tokens,
                    cached_tokens=self._cached.pop(e.request_id, 0), latency_s=round(e.latency, 4),
                    ttft_s=None if ttft is None else round(ttft, 4),
                )
