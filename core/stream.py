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

    With stop strings, `Token.text` never shows a stop string or what follows it: text that could still
    become one is held back and comes with a later token, so a finished sample's token texts add up to its
    `completion().text`.
    """

    def __init__(self, engine: Engine, collector: Collector):
        self.engine = engine
        self.collector = collector
        self.request_id: str = collector.samples[0].parent_id
        self._detok: dict[int, Detokenizer] = {}
        self._texts: dict[int, _StopText] = {}
        self._buffer: list[tuple[int, int]] = []
        self._stops = collector.samples[0].stop_strings  # (every sample has its request's)
        self._last: dict[int, int] = {}  # sample -> its final token's place in the buffer, once it has ended
        self._sent: dict[int, int] = {}  # sample -> tokens streamed (where its logprobs, if any, are read)

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
                    self._mark_last()
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
        last = self._last.get(index) == 0
        for i in self._last:
            self._last[i] -= 1
        detok = self._detok.get(index) or self._detok.setdefault(index, Detokenizer(self.engine.tokenizer))
        text = detok.add(tok)
        if self._stops:
            text = (self._texts.get(index) or self._texts.setdefault(index, _StopText(self._stops))).add(text, last)
        sample = self.collector.samples[index]
        if sample.logprobs is None:
            return Token(tok, text, index, sample.finish_reason if last else None)
        pos = self._sent[index] = self._sent.get(index, -1) + 1
        logprob, top = sample.logprobs[pos]
        return Token(tok, text, index, sample.finish_reason if last else None, logprob,
                     top if sample.params.logprobs else None)

    def _mark_last(self) -> None:
        """Note where each ended sample's final token lies in the buffer just taken (its held-back text goes
        out with it, and its finish reason). The engine ends a sample in the step that hands out its last token,
        before waking us."""
        self._last = {}
        for pos, (index, _) in enumerate(self._buffer):
            if self.collector.samples[index].status.done:
                self._last[index] = pos

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
                   s.finish_reason or "cancelled", None if s.logprobs is None else s.logprobs[: len(s.output_ids)])
            for s in sorted(self.collector.samples, key=lambda s: s.index)
        ]
        return Completion(
            request_id=self.request_id, prompt=first.request.prompt, prompt_token_ids=first.prompt_ids,
            samples=samples, error=next((s.error for s in self.collector.samples if s.error), None),
        )


async def finished(stream: TokenStream) -> Completion:
    """Read `stream` (a `TokenStream`, or a stream of its interface) to its end and return its completion, a failed
    request's too (its `error` says why) instead of raising."""
    async with stream:
        try:
            async for _ in stream:
                pass
        except RequestError:
            pass
        return stream.completion()


class _StopText:
    """One sample's streamed text cut at its first stop string: text that could still be the start of one is
    held back until it cannot (or the sample ends)."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.holdback = max(map(len, stops)) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False

    def add(self, piece: str, last: bool) -> str:
        if self.stopped:
            return ""
        self.text += piece
        # An occurrence starting before `sent` was complete when that text went out, and found then.
        hits = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            end = min(hits)
        else:
            end = len(self.text) if last else max(self.sent, len(self.text) - self.holdback)
        out, self.sent = self.text[self.sent : end], end
        return out
