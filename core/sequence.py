"""The engine's mutable view of one request while it runs."""

from __future__ import annotations

import time

import anyio
import torch

from jitney.core.request import Request, RequestStatus


class Sequence:
    """A request in flight: its tokens, how many of them are in the KV cache, and its output slot.

    The tokens still to run through the model are `token_ids[num_computed:]`; when a step computes the last
    of them, the model's next token is sampled. A decode step is the case where one token remains, so a
    request whose cache was dropped (soft reset) simply prefills its prompt and outputs again.
    """

    __slots__ = (
        "request", "request_id", "params", "prompt_ids", "output_ids", "num_computed", "status", "arrival",
        "stop_ids", "generator", "finish_reason", "error", "pending", "ready", "t_queued", "t_first_token",
    )

    def __init__(self, request: Request, prompt_ids: list[int], stop_ids: frozenset[int], arrival: int):
        self.request = request
        self.request_id: str = request.request_id  # type: ignore[assignment]
        self.params = request.params
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
                self.generator.manual_seed(self.params.seed)
        self.finish_reason: str | None = None
        self.error: str | None = None
        # Single-slot collector: tokens not yet taken by the consumer, and an event set when there are some.
        # The engine only appends and sets; a slow consumer takes them all at once later.
        self.pending: list[int] = []
        self.ready = anyio.Event()
        self.t_queued = time.perf_counter()
        self.t_first_token: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    def deliver(self, token_ids: list[int]) -> None:
        """Hand new tokens (or just the news that the request ended) to the consumer."""
        self.pending.extend(token_ids)
        self.ready.set()

    def take(self) -> list[int]:
        out, self.pending = self.pending, []
        if not self.status.done:
            self.ready = anyio.Event()
        return out
