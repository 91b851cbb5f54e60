"""The engine's mutable view of one request while it runs."""

from __future__ import annotations

import time
import uuid

import anyio
import torch

from jitney.core.request import Request, RequestStatus


class Collector:
    """What the consumer of one request reads: new tokens of all its samples, and whether they have all ended.

    Single-slot: the engine appends a step's tokens to the samples' `output_ids` and sets the event; the
    consumer takes everything it has not read yet at once, so a slow consumer never holds the engine back
    and never sees an unbounded queue of wake-ups.
    """

    __slots__ = ("samples", "read", "ready", "open")

    def __init__(self) -> None:
        self.samples: list[Sequence] = []
        # per sample (by index), how many of its output tokens the consumer has taken: the engine hands a
        # token over by appending it to `output_ids` alone (a step of 256 decodes builds no list per request)
        self.read: list[int] = []
        self.ready = anyio.Event()
        self.open = 0  # samples not ended yet

    @property
    def done(self) -> bool:
        return self.open == 0

    def end(self) -> None:
        """The news that one sample ended; wakes the consumer at once."""
        self.open -= 1
        self.ready.set()

    def take(self) -> list[tuple[int, int]]:
        """(sample index, token id) of every token not taken yet, sample by sample."""
        out = []
        for s in self.samples:
            ids, start = s.output_ids, self.read[s.index]
            if len(ids) > start:
                out += [(s.index, t) for t in ids[start:]]
                self.read[s.index] = len(ids)
        if not self.done:
            # the event loop's own event class, made directly: `anyio.Event()` looks the loop up each time
            # (~1 µs, for every token of every request)
            self.ready = type(self.ready)()
        return out


class Sequence:
    """One sample of a request in flight: its tokens, how many of them are in the KV cache, where its output
    goes. A request with ``n`` samples runs as one sequence until its prompt is done, then forks.

    The tokens still to run through the model are `token_ids[num_computed:]`; when a step computes the last
    of them, the model's next token is sampled. A decode step is the case where one token remains, so a
    request whose cache was dropped (soft reset) simply prefills its prompt and outputs again.
    """

    __slots__ = (
        "request", "request_id", "params", "prompt_ids", "output_ids", "num_computed", "status", "arrival",
        "stop_ids", "generator", "finish_reason", "error", "collector", "index", "forks", "t_queued",
        "t_first_token", "max_new_tokens", "stop_strings", "parent_id", "ngrams", "computed_before", "needs_logits",
        "logprobs", "processors", "state",
    )

    def __init__(
        self, request: Request, prompt_ids: list[int], stop_ids: frozenset[int], arrival: int,
        collector: Collector | None = None, index: int = 0, request_id: str | None = None, now: float | None = None,
    ):
        self.request = request
        self.index = index
        # the id the engine gave the request (the caller's, or one made at submit: the `Request` is not written)
        self.parent_id: str = request_id or request.request_id or uuid.uuid4().hex[:16]
        self.request_id: str = self.parent_id if index == 0 else f"{self.parent_id}#{index}"
        self.params = request.params
        # read for every token: kept here so that a step does not touch the params
        self.max_new_tokens = self.params.max_new_tokens
        self.stop_strings = self.params.stop
        # with `params.logprobs`: each output token's (log-probability, likeliest alternatives), in order
        self.logprobs: list | None = None if self.params.logprobs is None else []
        self.processors: tuple = ()  # the logits processors its rows run (`processors.chain`): `set_processors`
        # whether its rows need the step's whole logits (logprobs, or processors: `set_processors`), and so skip the
        # LM head's int8 screen and steps run ahead (speculative proposals are checked under them: `greedy_run`)
        self.needs_logits = self.logprobs is not None
        self.state: dict = {}  # theirs, from step to step (`processors.Row.state`)
        self.prompt_ids = prompt_ids
        self.output_ids: list[int] = []
        self.num_computed = 0
        self.status = RequestStatus.PENDING
        self.arrival = arrival
        self.stop_ids = stop_ids
        self.generator: torch.Generator | None = None
        if not self.params.greedy:
            self.generator = torch.Generator()
            if self.params.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(self.params.seed + index)
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.collector = collector or Collector()
        self.collector.samples.append(self)
        self.collector.read.append(0)
        self.collector.open += 1
        self.forks: list[Sequence] = []  # samples that fork from this one when its prompt is done
        self.t_queued = time.perf_counter() if now is None else now  # (`now`: by the engine's clock)
        self.t_first_token: float | None = None
        self.ngrams = None  # where its short runs of tokens occurred (`lookup.NgramIndex`), made at first use
        self.computed_before = 0  # tokens it had in the cache before its latest soft reset (they compute again)

    def set_processors(self, chain: tuple) -> None:
        self.processors = chain
        self.needs_logits = bool(chain) or self.logprobs is not None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return len(self.prompt_ids) + len(self.output_ids) - self.num_computed  # (asked for a few times a step)

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]


def greedy_decodes(entries: list[tuple[Sequence, int]]) -> bool:
    """Whether every entry of a step decodes one greedy sample: the steps speculation may take (the draft's
    `Engine._speculation`, prompt lookup's `lookup.guesses`)."""
    decoding = RequestStatus.DECODING
    return all(n == 1 and seq.status is decoding and seq.params.greedy and seq.remaining == 1
               for seq, n in entries)
