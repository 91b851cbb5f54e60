"""FIFO: active decodes, then active prefills, then waiting requests in arrival order."""

from __future__ import annotations

from jitney.core.config import EngineConfig
from jitney.core.sequence import Sequence
from jitney.schedulers.base import Batch, BatchBuilder, CacheView, decodes, prefills


class FifoScheduler:
    """The seed's default policy: decoding requests never wait behind prompts. Safety margin default 0.15."""

    default_safety_margin = 0.15

    def __init__(self, config: EngineConfig):
        self.config = config
        margin = config.safety_margin
        self.safety_margin = self.default_safety_margin if margin is None else margin

    def schedule(self, waiting: list[Sequence], active: list[Sequence], cache: CacheView) -> Batch:
        b = BatchBuilder(self.config, cache, self.safety_margin)
        b.add_decodes_then_prefills(active)
        b.add_waiting(waiting)
        return b.batch


class PrefillFirstScheduler(FifoScheduler):
    """Finishes prompts being prefilled in chunks before resuming decodes, then admits waiting requests.
    Safety margin default 0.0."""

    default_safety_margin = 0.0

    def schedule(self, waiting: list[Sequence], active: list[Sequence], cache: CacheView) -> Batch:
        b = BatchBuilder(self.config, cache, self.safety_margin)
        b.add_active(prefills(active) + decodes(active))
        b.add_waiting(waiting)
        return b.batch
