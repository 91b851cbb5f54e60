"""The built-in schedulers, registered through the same entry point a third-party package uses.

A scheduler plugin builds on `jitney.schedulers.base` (the `Scheduler` role, `BatchBuilder` and the selection
helpers `decodes`, `prefills`, `decodes_then_prefills`)."""

from jitney.core.hooks import hookimpl
from jitney.schedulers.fair_share import FairShareScheduler
from jitney.schedulers.fifo import FifoScheduler, PrefillFirstScheduler
from jitney.schedulers.priority import PriorityScheduler


@hookimpl
def jitney_register_schedulers(register):
    register("fifo", FifoScheduler)
    register("prefill_first", PrefillFirstScheduler)
    register("priority", PriorityScheduler)
    register("fair_share", FairShareScheduler)
