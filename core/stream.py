"""What `Engine.stream` returns: a request's tokens as an async iterator and an async context manager."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jitney.core.detokenizer import Detokenizer
from jitney.core.request import Completion, RequestError, RequestStatus, Sample, Token, cut_at_stop
from jitney.core.sequence import Collector

if TYPE_CHECKING:
    from jitney.core.engine import Engine


class TokenStream:
    """The tokens of one request, as an async iterator and an async context manager.

    With ``n > 1`` the samples' tokens interleave; `Token.index` says which sample each belongs to. Leaving
    early — `break`, an exception, cancellation — aborts the request and frees its cache. A request that
    failed raises `RequestError` after the tokens it produced.
    """

    def __init__(self, engine: Engine, collector: Collector):
        self.engine = engine
        self.collector = collector
        self.request_id: str = collector.samples[0].request.request_id  # type: ignore[assignment]
        self._detok: dict[int, Detokenizer] = {}
        self._buffer: list[tuple[int, int]] = []

    @property
    def done(self) -> bool:
        return self.collector.done

    def __aiter__(self) -> "TokenStream":
        return self

    async def __anext__(self) -> Token:
        collector = self.collector
        try:
            while not self._buffer:
                self._buffer = collector.take()
                if self._buffer:
                    break
                if collector.done:
                    failed = [s for s in collector.samples if s.status is RequestStatus.FAILED]
                    if failed:
                        raise RequestError(f"request {self.request_id} failed: {failed[0].error}")
                    raise StopAsyncIteration
                await collector.ready.wait()
        except BaseException as exc:
            if not isinstance(exc, (StopAsyncIteration, RequestError)):
                self.engine.abort(self.request_id)
            raise
        index, tok = self._buffer.pop(0)
        detok = self._detok.get(index) or self._detok.setdefault(index, Detokenizer(self.engine.tokenizer))
        return Token(tok, detok.add(tok), index)

    async def __aenter__(self) -> "TokenStream":
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.engine.abort(self.request_id)

    def __del__(self) -> None:
        # `async for t in engine.stream(r): break` drops the stream at once: abort there too.
        collector = getattr(self, "collector", None)
        if collector is not None and not collector.done and self.engine._running:
            self.engine.abort(self.request_id)

    def completion(self) -> Completion:
        if not self.collector.done:
            raise RuntimeError("the request has not finished")
        first = self.collector.samples[0]
        samples = [
            Sample(s.index, list(s.output_ids), cut_at_stop(self.engine.decode(s.output_ids), s.params.stop)[0],
                   s.finish_reason or "cancelled")
            for s in sorted(self.collector.samples, key=lambda s: s.index)
        ]
        return Completion(
            request_id=self.request_id, prompt=first.request.prompt, prompt_token_ids=first.prompt_ids,
            samples=samples, error=next((s.error for s in self.collector.samples if s.error), None),
        )
