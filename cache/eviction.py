"""Eviction policies: which cached block is demoted when the pool needs a fresh one.

A policy is one method (the shape of SGLang's ``EvictionStrategy``): a sortable priority for a cached block;
the block with the lowest priority is demoted first. Priorities are taken when a block becomes evictable
(its last user released it) and do not change while it waits. Whatever the priorities, the pool demotes a
prefix from its leaves: never a block that another hashed block extends. Policies that keep state of their own
(ghost lists: 2Q, ARC, S3-FIFO) may also define the optional methods of `EvictionPolicy`.
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
    hash: int
    """Its content hash (chained over its whole prefix): the same content has the same hash when computed again."""
    depth: int
    """Its place in its prefix chain: 0 for a prompt's first block."""
    extended: bool
    """Whether other hashed blocks extend its prefix, when it became cached (the pool never demotes such a
    block before them, whatever its priority)."""


class EvictionPolicy(Protocol):
    """Registered with ``jitney_register_eviction_policies`` as ``factory(config)``; selected by
    ``EngineConfig(eviction=name)``."""

    def priority(self, block: BlockStats) -> Any:
        """Lower is demoted first."""

    # Optional, each called by the pool when it happens (a method a policy lacks is not called):
    #   setup(num_blocks)   once, when the pool is built: size ghost lists from it
    #   on_insert(block)    a block became cached (its last owner released it), just before `priority`
    #   on_hit(block)       a request took a block holding hashed content (cached, or shared while in use)
    #   on_demote(block)    a cached block is demoted, its hash still set (remember it in a ghost list)
    # As with `priority`, one that raises makes the pool fall back to the seed's rule.


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


class TwoQueue:
    """2Q (Johnson & Shasha): blocks never reused since they were computed (the A1 queue) go first, oldest
    content first; blocks reused (Am) go last, least recently used first. A block demoted from A1 leaves its
    hash in a ghost list (A1out, a quarter of the cache): content computed again while remembered there counts
    as reused, so a prefix that returns after a burst of one-off prompts is kept the second time."""

    def setup(self, num_blocks: int) -> None:
        self.ghost_limit = max(1, num_blocks // 4)
        self.ghosts: dict[int, None] = {}  # (insertion-ordered: the oldest ghost is forgotten first)

    def on_demote(self, block: BlockStats) -> None:
        if not block.hits:
            self.ghosts[block.hash] = None
            if len(self.ghosts) > self.ghost_limit:
                del self.ghosts[next(iter(self.ghosts))]

    def priority(self, block: BlockStats) -> Any:
        if block.hits or block.hash in self.ghosts:
            return (1, block.last_access)
        return (0, block.created)


@hookimpl
def jitney_register_eviction_policies(register):
    register("mru", lambda config: MostRecentFirst())
    register("lru", lambda config: LeastRecentlyUsed())
    register("lfu", lambda config: LeastFrequentlyUsed())
    register("fifo", lambda config: FirstInFirstOut())
    register("2q", lambda config: TwoQueue())
