"""The scheduler role: what a scheduler is given each step, what it returns, and a helper that keeps budgets."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from jitney.core.config import EngineConfig
from jitney.core.sequence import Sequence


class CacheView(Protocol):
    """The part of the cache manager a scheduler may use: ask what fits, and reserve it."""

    num_blocks: int
    block_size: int

    @property
    def num_free_blocks(self) -> int: ...

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New blocks `request_id` needs to hold `num_tokens` tokens in all."""

    def blocks_held(self, request_id: str) -> int:
        """Blocks `request_id` holds now (what preempting it would free)."""

    def reserve(self, request_id: str, num_tokens: int) -> bool:
        """Allocate, all layer groups or none, so that `request_id` holds `num_tokens` tokens; False if it cannot."""

    def match_prefix(self, seq: Sequence) -> int:
        """For a request holding no blocks: take the cached blocks of its prefix, count them as computed, and
        return how many tokens they cover (0 when prefix caching is off)."""

    def release(self, request_id: str) -> None:
        """Give back every block a request holds; used to undo `match_prefix` for a request that did not start."""


@dataclass
class Batch:
    """What `Scheduler.schedule` returns for one step."""

    entries: list[tuple[Sequence, int]] = field(default_factory=list)
    """(request, tokens to compute this step), in the order chosen; their cache is reserved."""
    stalled: list[tuple[Sequence, int]] = field(default_factory=list)
    """Active requests that could not get the blocks they need this step, with how many they need."""
    preempt: list[Sequence] = field(default_factory=list)
    """Active requests the scheduler wants out of the cache; the engine frees them and calls `schedule` again."""

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.entries)


class Scheduler(Protocol):
    """Builds each step's batch. A plugin registers ``factory(config) -> Scheduler`` under a name with
    ``jitney_register_schedulers``; ``EngineConfig(scheduler=name)`` selects it.

    Each step the engine calls `schedule` with

    - ``waiting``: requests that hold no cache yet, in arrival order (new ones, and ones whose cache was
      dropped by a soft reset, which then prefill their prompt plus the tokens they already produced);
    - ``active``: requests that hold cache, in arrival order; ``seq.remaining == 1`` is a decode, more is a
      prefill in progress;
    - ``cache``: a `CacheView` to ask whether a request's next tokens fit and to reserve them.

    It returns a `Batch`. Three budgets bound a batch: ``config.max_batch_tokens`` query tokens (a prompt
    chunk's counted with its attention's work, ``config.chunk_context_cost``),
    ``config.max_requests_per_batch`` requests, and the cache budget, ``config.max_batch_cache_blocks`` KV
    blocks read in one pass (at most the cache's size). `BatchBuilder` keeps all three, and the safety margin.

    The engine owns both lists and moves requests between them as they are admitted, finish, are aborted or
    fail, or are soft reset: a scheduler only chooses, so it needs no bookkeeping of its own. Each request
    carries ``seq.request.priority`` (lower runs first where a policy honours it) and ``seq.arrival``.

    A scheduler that reacts to lifecycle events (a request queued, its first token, finished, failed, soft
    reset; the step's statistics — see `jitney.core.events`) may also define ``on_events(events)``: the engine
    calls it once per step, before the observers, with that step's events.
    """

    def schedule(self, waiting: list[Sequence], active: list[Sequence], cache: CacheView) -> Batch: ...


class BatchBuilder:
    """Adds requests to a batch in the order a policy chooses, keeping the three budgets and the safety margin.

    `add` returns "ok" when the request joined, "full" when a budget is spent (later requests will not fit
    either), "cache" when the cache lacks the blocks (or, for a new prefill, the margin forbids them).
    """

    def __init__(self, config: EngineConfig, cache: CacheView, safety_margin: float):
        self.cache = cache
        self.batch = Batch()
        self.tokens_left = config.max_batch_tokens
        self.context_cost = config.chunk_context_cost or 0.0
        self.requests_left = config.max_requests_per_batch
        limit = config.max_batch_cache_blocks
        self.blocks_left = cache.num_blocks if limit is None else min(limit, cache.num_blocks)
        self.reserve_floor = safety_margin * cache.num_blocks

    @property
    def full(self) -> bool:
        return self.tokens_left == 0 or self.requests_left == 0 or self.blocks_left <= 0

    def add(self, seq: Sequence, new: bool = False) -> str:
        """Add `seq` with as many of its remaining tokens as the token budget allows (a chunk of its prompt,
        its tokens counted with their attention's work: `EngineConfig.chunk_context_cost`).

        `new` marks a request from the waiting list: below `safety_margin x num_blocks` free blocks it does not
        start, unless the batch would otherwise be empty.
        """
        if self.tokens_left == 0 or self.requests_left == 0 or self.blocks_left <= 0:  # (`full`, inlined)
            return "full"
        cache = self.cache
        if new:
            if self.batch.entries and cache.num_free_blocks < self.reserve_floor:
                return "cache"
            cache.match_prefix(seq)
        n = len(seq.prompt_ids) + len(seq.output_ids) - seq.num_computed  # (`remaining`, without the call)
        if n > self.tokens_left:
            n = self.tokens_left
        cost = n
        if n > 1 and self.context_cost:
            n, cost = self.chunk(seq.num_computed, n)
        total = seq.num_computed + n
        reads = -(-total // cache.block_size)
        need = cache.blocks_needed(seq.request_id, total)
        result = "ok"
        # (most decodes need no new block: they skip the free count and the reservation)
        if n == 0:  # not one token of the chunk fits what the batch has left
            result = "full"
        elif need and need > cache.num_free_blocks:
            result = "cache"
            if not new:
                self.batch.stalled.append((seq, need))
        elif reads > self.blocks_left and self.batch.entries:
            result = "full"
        elif need and not cache.reserve(seq.request_id, total):
            result = "cache"
        if result != "ok":
            if new:  # undo the prefix match: the cached blocks stay cached, and may be demoted meanwhile
                self.cache.release(seq.request_id)
                seq.num_computed = 0
            return result
        self.batch.entries.append((seq, n))
        self.tokens_left -= cost
        self.requests_left -= 1
        self.blocks_left -= reads
        return "ok"

    def chunk(self, computed: int, most: int) -> tuple[int, int]:
        """The longest chunk of at most `most` tokens after `computed` ones whose count fits the token budget,
        and that count (rounded up): n tokens count n + cost x (n x computed + n (n + 1) / 2), each attending
        to the positions before it and itself. (0, 0) when not one token fits, except in an empty batch, which
        takes one token whatever it counts (every step makes progress)."""
        k, left = self.context_cost, self.tokens_left

        def count(n: int) -> float:
            return n + k * (n * computed + n * (n + 1) / 2)

        b = 1 + k * computed + k / 2  # count(n) = k / 2 n^2 + b n: its root at `left`, in a form without 1 / k
        n = min(most, int(2 * left / (b + math.sqrt(b * b + 2 * k * left))))
        while n > 0 and count(n) > left:  # (float rounding)
            n -= 1
        if n == 0:
            return (1, left) if not self.batch.entries else (0, 0)
        return n, min(left, math.ceil(count(n)))

    def add_active(self, seqs: list[Sequence]) -> None:
        """Add running requests in the given order, until a budget is spent."""
        self._add_active(seqs, prefills_last=False)

    def add_decodes_then_prefills(self, seqs: list[Sequence]) -> None:
        """``add_active(decodes_then_prefills(seqs))`` in one pass over `seqs` (the FIFO order)."""
        self._add_active(seqs, prefills_last=True)

    def _add_active(self, seqs: list[Sequence], prefills_last: bool) -> None:
        # Most of a step's requests are decodes within their last block: those join here at the cost of a few
        # integer tests (a scheduler's hottest loop); `add` takes the others. The cache always holds a request's
        # computed tokens, so a decode whose position is not the first of a block needs no new one.
        bs = self.cache.block_size
        entries = self.batch.entries
        prefills = []
        for seq in seqs:
            computed = seq.num_computed
            left = len(seq.prompt_ids) + len(seq.output_ids) - computed
            if left != 1 and prefills_last:
                if left > 1:
                    prefills.append(seq)
                continue
            reads = computed // bs + 1
            if left == 1 and computed % bs and self.tokens_left and self.requests_left and reads <= self.blocks_left:
                entries.append((seq, 1))
                self.tokens_left -= 1
                self.requests_left -= 1
                self.blocks_left -= reads
            elif self.add(seq) == "full":
                return
        for seq in prefills:
            if self.add(seq) == "full":
                return

    def add_waiting(self, seqs: list[Sequence]) -> Sequence | None:
        """Admit waiting requests in order; stop at the first that does not fit (later ones do not overtake
        it). Returns that request when the cache, not a budget, held it back."""
        for seq in seqs:
            result = self.add(seq, new=True)
            if result != "ok":
                return seq if result == "cache" else None
        return None


def decodes(active: list[Sequence]) -> list[Sequence]:
    return [s for s in active if s.remaining == 1]


def prefills(active: list[Sequence]) -> list[Sequence]:
    return [s for s in active if s.remaining > 1]


def decodes_then_prefills(active: list[Sequence]) -> list[Sequence]:
    """``decodes(active) + prefills(active)`` in one pass (the FIFO order; a scheduler's hottest line)."""
    dec: list[Sequence] = []
    pre: list[Sequence] = []
    for s in active:
        left = s.remaining
        if left == 1:
            dec.append(s)
        elif left > 1:
            pre.append(s)
    return dec + pre
