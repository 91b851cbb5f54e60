"""Eviction policies: which cached block is demoted when the pool needs a fresh one.

A policy is one method (the shape of SGLang's ``EvictionStrategy``): a sortable priority for a cached block;
the block with the lowest priority is demoted first. Priorities are taken when a block becomes evictable
(its last user released it) and do not change while it waits.
"""

from __future__ import annotations

from typing import Any, Protocol

from jitney.core.hooks import hookimpl


class BlockStats(Protocol):
    """What a policy may rank a cached block by. Times are the pool's logical clock (one tick per event)."""

    created: int
    """When the block's current content was first written."""
    last_access: int
    """When a request last took or released it."""
    hits: int
    """How many times a later request reused it since it was written."""


class EvictionPolicy(Protocol):
    """Registered with ``jitney_register_eviction_policies`` as ``factory(config)``; selected by
    ``EngineConfig(eviction=name)``."""

    def priority(self, block: BlockStats) -> Any:
        """Lower is demoted first."""


class MostRecentFirst:
    """The seed's rule: the block released most recently goes first (older prefixes, e.g. a system prompt
    released long ago by many requests, survive a burst of one-off prompts)."""

    def priority(self, block: BlockStats) -> Any:
        return -block.last_access


class LeastRecentlyUsed:
    def priority(self, block: BlockStats) -> Any:
        return block.last_access


class LeastFrequentlyUsed:
    """Fewest reuses first; among equals, the least recently used."""

    def priority(self, block: BlockStats) -> Any:
        return (block.hits, block.last_access)


class FirstInFirstOut:
    """Oldest content first, however often it was reused."""

    def priority(self, block: BlockStats) -> Any:
        return block.created


@hookimpl
def jitney_register_eviction_policies(register):
    register("mru", lambda config: MostRecentFirst())
    register("lru", lambda config: LeastRecentlyUsed())
    register("lfu", lambda config: LeastFrequentlyUsed())
    register("fifo", lambda config: FirstInFirstOut())
