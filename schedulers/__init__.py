"""Scheduler plugins: the `Scheduler` role and the built-in policies."""

from jitney.core.hooks import hookimpl
from jitney.schedulers.base import Batch, CacheView, Scheduler
from jitney.schedulers.fifo import FifoScheduler

__all__ = ["Batch", "CacheView", "FifoScheduler", "Scheduler"]


@hookimpl
def jitney_register_schedulers(register):
    register("fifo", FifoScheduler)
