"""The block pool: which KV-cache blocks are free, in use, or cached for later prefix hits."""

from __future__ import annotations

import heapq
import logging
from typing import Any

from jitney.cache.eviction import EvictionPolicy, MostRecentFirst

log = logging.getLogger("jitney")


class Block:
    """One block's bookkeeping (its KV lives in the cache tensors)."""

    __slots__ = ("id", "ref_count", "hash", "created", "last_access", "hits", "version", "parent", "depth", "extended")

    def __init__(self, block_id: int):
        self.id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.created = self.last_access = self.hits = 0
        self.version = 0  # bumped whenever the block leaves the cached set, to drop stale heap entries
        self.parent: int | None = None  # the hash of the prefix this block's content extends, while hashed
        self.depth = 0  # its place in its prefix chain (0: a prompt's first block), while hashed
        self.extended = False  # whether hashed blocks extend its prefix (as of its last release)


class BlockPool:
    """Hands out block ids ``0 .. num_blocks-1``; ids ``num_blocks`` and ``num_blocks+1`` are reserved.

    A block is *free* (no content), *used* (``ref_count`` owners) or *cached*: no owner, but its content and
    hash are kept so a later request with the same prefix can take it back. Cached blocks count as
    available; when the free ones run out, the eviction policy picks which cached block is demoted (its hash
    dropped) and reused. The two reserved blocks are never allocated: padding tokens read and write there.

    Cached blocks are demoted from the leaves of their prefix chains: never a block that a hashed block
    extends, whatever the policy ranks (a prefix whose first block is gone can never be matched again, while
    the rest of it would still count as cached).

    A policy that raises, or whose priorities do not compare, is replaced by the seed's rule (most recent
    first) for the rest of the pool's life, with one error logged: which block is demoted never changes a
    token, so no request needs to fail for it.
    """

    def __init__(self, num_blocks: int, policy: EvictionPolicy | None = None):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1 (got {num_blocks})")
        self.num_blocks = num_blocks
        self.padding_block = num_blocks
        self.policy = policy or MostRecentFirst()
        self._hooks = {}
        self.blocks = [Block(i) for i in range(num_blocks)]
        # A stack: the most recently freed block is reused first, while its memory is still warm.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._cached: set[int] = set()
        self._heap: list[tuple[Any, int, int, int]] = []  # (priority, tiebreak, block id, version)
        self.index: dict[int, int] = {}  # content hash -> block id, for every block holding hashed content
        self.extended: dict[int, int] = {}  # content hash -> hashed blocks extending it (kept by content, not block)
        self.clock = 0
        self.demoted = 0
        self._bind_hooks()
        self._notify("setup", num_blocks)

    def _bind_hooks(self) -> None:
        """The policy's optional methods (`EvictionPolicy`), looked up once."""
        self._hooks = {name: getattr(self.policy, name, None) for name in ("setup", "on_insert", "on_hit", "on_demote")}

    def _notify(self, name: str, arg) -> None:
        hook = self._hooks.get(name)
        if hook is not None:
            try:
                hook(arg)
            except Exception as exc:
                self._replace_policy(exc)

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated: free plus cached."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Blocks with no owner whose content is kept for prefix hits (demoted when the free ones run out)."""
        return len(self._cached)

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def allocate(self, n: int) -> list[int]:
        # (every step, for each decode that starts a block: the free count and the clock's tick inlined)
        free = self._free
        if n > len(free) + len(self._cached):
            raise RuntimeError(f"asked for {n} blocks, {self.num_free} available")
        out = []
        for _ in range(n):
            block_id = free.pop() if free else self._demote()
            block = self.blocks[block_id]
            block.ref_count = 1
            self.clock += 1
            block.created = block.last_access = self.clock
            block.hits = 0
            out.append(block_id)
        return out

    def _demote(self) -> int:
        passed = []  # blocks the policy ranked first that other hashed blocks extend: back in the heap after
        while True:
            if not self._heap:  # each cached block is extended by one in use (a prefix computed twice at once)
                entry = passed.pop(0)
                block_id, block = entry[2], self.blocks[entry[2]]
                break
            try:
                entry = heapq.heappop(self._heap)
            except TypeError as exc:  # priorities that do not compare
                self._replace_policy(exc)
                passed = []  # (the heap is rebuilt from every cached block)
                continue
            block_id, version = entry[2], entry[3]
            block = self.blocks[block_id]
            if block_id in self._cached and block.version == version:
                if not self.extended.get(block.hash):
                    break
                passed.append(entry)
        for entry in passed:
            heapq.heappush(self._heap, entry)
        self._notify("on_demote", block)
        self._cached.discard(block_id)
        block.version += 1
        del self.index[block.hash]
        block.hash = None
        if block.parent is not None:
            left = self.extended[block.parent] - 1
            if left:
                self.extended[block.parent] = left
            else:
                del self.extended[block.parent]
            block.parent = None
        self.demoted += 1
        return block_id

    def take(self, block_id: int) -> None:
        """A prefix hit: one more owner for a block holding hashed content."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._cached.discard(block_id)
            block.version += 1
        block.ref_count += 1
        block.hits += 1
        block.last_access = self._tick()
        self._notify("on_hit", block)

    def share(self, block_id: int) -> None:
        """One more owner for a block in use (a forked sample)."""
        self.blocks[block_id].ref_count += 1

    def free(self, ids: list[int]) -> None:
        """Drop one owner of each block; a block nobody owns is cached if it holds hashed content, else free."""
        for block_id in reversed(ids):  # the tail of a sequence is the first to be demoted under LIFO ties
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count:
                continue
            block.last_access = self._tick()
            if block.hash is None:
                self._free.append(block_id)
            else:
                self._cached.add(block_id)
                block.extended = block.hash in self.extended
                self._notify("on_insert", block)
                try:
                    heapq.heappush(self._heap, (self.policy.priority(block), self.clock, block_id, block.version))
                except Exception as exc:
                    self._replace_policy(exc)
        if len(self._heap) > 4 * self.num_blocks:  # drop entries of blocks taken back since they were pushed
            self._heap = [e for e in self._heap if e[2] in self._cached and self.blocks[e[2]].version == e[3]]
            heapq.heapify(self._heap)

    def _replace_policy(self, exc: Exception) -> None:
        """Fall back to the seed's rule, every cached block ranked again by it."""
        log.error("eviction policy %s failed: %s: %s; cached blocks are demoted most recent first from now on",
                  type(self.policy).__name__, type(exc).__name__, exc, exc_info=exc)
        self.policy = MostRecentFirst()
        self._bind_hooks()
        self._heap = [(self.policy.priority(self.blocks[b]), self.blocks[b].last_access, b, self.blocks[b].version)
                      for b in self._cached]
        heapq.heapify(self._heap)

    def register(self, block_id: int, content_hash: int, parent_hash: int | None = None) -> bool:
        """Record that a used block now holds the content `content_hash`, extending the prefix whose last block
        holds `parent_hash` (None: the first block); False if another block has it."""
        if content_hash in self.index:
            return False
        self.index[content_hash] = block_id
        block = self.blocks[block_id]
        block.hash = content_hash
        block.depth = 0
        if parent_hash is not None:
            block.parent = parent_hash
            self.extended[parent_hash] = self.extended.get(parent_hash, 0) + 1
            parent = self.index.get(parent_hash)
            block.depth = 0 if parent is None else self.blocks[parent].depth + 1
        return True

    def lookup(self, content_hash: int) -> int | None:
        return self.index.get(content_hash)
