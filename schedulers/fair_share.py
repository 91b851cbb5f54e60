"""Fair share: tenants take turns at the queue, the one served the fewest tokens so far first."""

from __future__ import annotations

from collections import Counter

from jitney.core import events as ev
from jitney.core.config import EngineConfig
from jitney.core.sequence import Sequence
from jitney.schedulers.base import Batch, BatchBuilder, CacheView
from jitney.schedulers.fifo import FifoScheduler


def tenant(seq: Sequence) -> str:
    """A request's tenant: `metadata["tenant"]`, else `metadata["user"]` (what the server fills), else ""."""
    meta = seq.request.metadata or {}
    return str(meta.get("tenant", meta.get("user", "")))


class FairShareScheduler(FifoScheduler):
    """Running requests as FIFO does; waiting ones admitted tenant by tenant, the tenant served the fewest
    tokens so far first (FIFO within a tenant), so one tenant's burst cannot hold the others' requests back."""

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.served: Counter[str] = Counter()  # tokens generated per tenant
        self.tenant_of: dict[str, str] = {}  # request id -> tenant, while it runs

    def schedule(self, waiting: list[Sequence], active: list[Sequence], cache: CacheView) -> Batch:
        b = BatchBuilder(self.config, cache, self.safety_margin)
        b.add_decodes_then_prefills(active)
        for seq in waiting:
            self.tenant_of[seq.request_id] = tenant(seq)
        b.add_waiting(sorted(waiting, key=lambda s: (self.served[self.tenant_of[s.request_id]], s.arrival)))
        return b.batch

    def on_events(self, events: list) -> None:
        for e in events:
            if isinstance(e, ev.TokensGenerated):
                self.served[self.tenant_of.get(e.request_id, "")] += e.tokens
            elif isinstance(e, ev.RequestFinished):
                self.tenant_of.pop(e.request_id, None)
