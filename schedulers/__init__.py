"""Scheduler plugins: the `Scheduler` role, a budget-keeping helper, and the built-in policies."""

from jitney.core.hooks import hookimpl
from jitney.schedulers.base import Batch, BatchBuilder, CacheView, Scheduler, decodes, decodes_then_prefills, prefills
from jitney.schedulers.fair_share import FairShareScheduler
from jitney.schedulers.fifo import FifoScheduler, PrefillFirstScheduler
from jitney.schedulers.priority import PriorityScheduler

__all__ = [
    "Batch", "BatchBuilder", "CacheView", "FairShareScheduler", "FifoScheduler", "PrefillFirstScheduler", "PriorityScheduler",
    "Scheduler", "decodes", "decodes_then_prefills", "prefills",
]


@hookimpl
def jitney_register_schedulers(register):
    register("fifo", FifoScheduler)
    register("prefill_first", PrefillFirstScheduler)
    register("priority", PriorityScheduler)
    register("fair_share", FairShareScheduler)
