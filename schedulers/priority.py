"""Priority classes: interactive requests first; background work is preempted when the cache is short."""

from __future__ import annotations

from jitney.core.sequence import Sequence
from jitney.schedulers.base import Batch, BatchBuilder, CacheView
from jitney.schedulers.fifo import FifoScheduler


class PriorityScheduler(FifoScheduler):
    """Serves priority classes in order (lower `Request.priority` first), FIFO within a class.

    When a class is short of cache (an active request stalls, or a waiting one cannot start), the newest
    active requests of lower classes (higher numbers) are preempted, just enough to cover the shortfall; the engine frees them (soft reset) and they queue again.
    Lower classes are never starved by the scheduler itself: they get whatever budget the higher classes
    leave, and run to completion when higher-class load pauses.
    """

    def schedule(self, waiting: list[Sequence], active: list[Sequence], cache: CacheView) -> Batch:
        b = BatchBuilder(self.config, cache, self.safety_margin)
        for level in sorted({s.request.priority for s in waiting + active}):
            mine = [s for s in active if s.request.priority == level]
            stalled_before = len(b.batch.stalled)
            b.add_decodes_then_prefills(mine)
            short = sum(need for _, need in b.batch.stalled[stalled_before:])
            blocked = b.add_waiting([s for s in waiting if s.request.priority == level])
            if blocked is not None:
                short += cache.blocks_needed(blocked.request_id, blocked.num_computed + min(blocked.remaining, b.tokens_left))
            if short:
                lower = [s for s in active if s.request.priority > level]
                victims = self._victims(max(1, short - cache.num_free_blocks), lower, cache)
                if victims:
                    return Batch(preempt=victims)
            if b.full or short:
                break  # a class that is short of cache is not overtaken by lower classes
        return b.batch

    @staticmethod
    def _victims(need: int, lower: list[Sequence], cache: CacheView) -> list[Sequence]:
        """The newest lower-class requests whose blocks cover `need`; none if all of them would not."""
        victims, freed = [], 0
        for victim in sorted(lower, key=lambda s: s.arrival, reverse=True):
            if freed >= need:
                break
            victims.append(victim)
            freed += cache.blocks_held(victim.request_id)
        return victims if freed >= need else []
