"""FIFO: active decodes, then active prefills, then waiting requests in arrival order."""

from __future__ import annotations

from jitney.core.config import EngineConfig
from jitney.core.sequence import Sequence
from jitney.schedulers.base import Batch, CacheView


class FifoScheduler:
    """The seed's default policy. Prompts longer than the token budget left are chunked; below
    `safety_margin` x the cache's blocks free, no new prefill starts while decodes go on."""

    default_safety_margin = 0.15

    def __init__(self, config: EngineConfig):
        self.max_tokens = config.max_batch_tokens
        self.max_requests = config.max_requests_per_batch
        margin = self.default_safety_margin if config.safety_margin is None else config.safety_margin
        self.safety_margin = margin

    def schedule(self, waiting: list[Sequence], active: list[Sequence], cache: CacheView) -> Batch:
        batch = Batch()
        budget = self.max_tokens
        decodes = [s for s in active if s.remaining == 1]
        prefills = [s for s in active if s.remaining > 1]
        for seq in decodes + prefills:
            if budget == 0 or len(batch.entries) == self.max_requests:
                return batch
            n = min(seq.remaining, budget)
            if cache.reserve(seq.request_id, seq.num_computed + n):
                batch.entries.append((seq, n))
                budget -= n
            else:
                batch.stalled.append(seq)
        reserve_floor = self.safety_margin * cache.num_blocks
        for seq in waiting:
            if budget == 0 or len(batch.entries) == self.max_requests:
                break
            n = min(seq.remaining, budget)
            need = cache.blocks_needed(seq.request_id, seq.num_computed + n)
            if cache.num_free_blocks - need < reserve_floor or not cache.reserve(seq.request_id, seq.num_computed + n):
                break  # arrival order: later requests do not overtake the head of the queue
            batch.entries.append((seq, n))
            budget -= n
        return batch
