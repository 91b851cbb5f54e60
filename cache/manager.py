"""The cache manager: per-layer KV tensors, layer groups, block tables, and prefix caching."""

from __future__ import annotations

import math
import mmap
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from jitney.cache.eviction import EvictionPolicy
from jitney.cache.pool import BlockPool
from jitney.core.sequence import Sequence


@dataclass(frozen=True)
class LayerGroup:
    """Layers that share block ids: a request holds one block table per group.

    In a sliding-window group (`window` set) blocks that slid entirely out of the window are given back as
    the request advances; their table entries become the pool's padding block, a sentinel no read reaches
    unmasked."""

    name: str
    layers: tuple[int, ...]
    window: int | None = None


def blocks_view(store: torch.Tensor, block_size: int) -> torch.Tensor:
    """A layer's key or value storage as [kv_heads, blocks, block_size * head_dim] (a view, no copy)."""
    kvh, dim = store.shape[1], store.shape[2]
    return store.transpose(0, 1).view(kvh, -1, block_size * dim)


def block_hashes(tokens: list[int], block_size: int) -> Iterator[int]:
    """The chained hash of each full block of `tokens`: a block's hash covers every token before it, so equal
    hashes mean equal prefixes. (Hashes of ints and tuples do not depend on the process: a router elsewhere
    computes the same ones.)"""
    prev = 0
    for i in range(len(tokens) // block_size):
        prev = hash((prev, tuple(tokens[i * block_size : (i + 1) * block_size])))
        yield prev


def on_huge_pages(device: torch.device) -> bool:
    """Whether the cache's storage on `device` is mapped here for huge pages (a Linux CPU), the path that can
    commit its pages up front."""
    return device.type == "cpu" and hasattr(mmap, "MADV_HUGEPAGE")


def _storage(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, commit: bool = False) -> torch.Tensor:
    """`torch.empty`, except that CPU storage (on Linux) is advised for transparent huge pages: decode
    attention reads a request's blocks, 4 KiB a head at `block_size` 16 for SmolLM2, from anywhere in the
    cache, and on 4 KiB pages each block costs a TLB miss. Pages are committed when first written, or here
    with `commit` (one write a page, on this thread: no OpenMP team left on the caller's thread)."""
    if not on_huge_pages(device):
        return torch.empty(shape, dtype=dtype, device=device)
    huge = 2 << 20
    nbytes = math.prod(shape) * dtype.itemsize
    buffer = mmap.mmap(-1, nbytes + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # the tensor keeps it
    buffer.madvise(mmap.MADV_HUGEPAGE)
    if commit:
        np.frombuffer(buffer, dtype=np.uint8)[:: mmap.PAGESIZE] = 0
    raw = torch.frombuffer(buffer, dtype=torch.uint8)
    start = -raw.data_ptr() % huge  # from a huge page's boundary
    return raw[start : start + nbytes].view(dtype).view(shape)


class TableRows:
    """Every request's block tables again, as rows of one int64 array per group (padded with the group's
    padding block), kept in step with the lists by `CacheManager`: a step's tables are then one indexing
    call, where packing them from the lists cost ~35% of preparing a decode step at 256 requests (4,400
    block ids)."""

    def __init__(self, pads: list[int], slots: int = 64, width: int = 64):
        self.pads = pads
        self.width = width
        self.rows = [np.full((slots, width), pad, dtype=np.int64) for pad in pads]
        self.lens = np.zeros(slots, dtype=np.int64)
        self.slot: dict[str, int] = {}
        self.free = list(range(slots - 1, -1, -1))

    def write(self, request_id: str, tables: list[list[int]], start: int = 0) -> None:
        """Copy `tables[g][start:]` into the request's rows (every group's table has the same length)."""
        slot = self.slot.get(request_id)
        if slot is None:
            if not self.free:
                self._grow(len(self.lens) * 2, self.rows[0].shape[1])
            slot = self.slot[request_id] = self.free.pop()
        n = len(tables[0])
        if n > self.width:
            self._grow(len(self.lens), max(n, 2 * self.width))
        if n - start == 1:  # (a decode's next block: one element, ~4x cheaper than a slice from a list)
            for rows, table in zip(self.rows, tables):
                rows[slot, start] = table[start]
        else:
            for rows, table in zip(self.rows, tables):
                rows[slot, start:n] = table[start:]
        self.lens[slot] = n

    def drop(self, request_id: str) -> None:
        slot = self.slot.pop(request_id, None)
        if slot is not None:
            for rows, pad in zip(self.rows, self.pads):
                rows[slot, : self.lens[slot]] = pad
            self.lens[slot] = 0
            self.free.append(slot)

    def gather(self, request_ids: list[str], group: int) -> torch.Tensor:
        """[len(request_ids), longest table] the requests' tables in this group, in their order."""
        slots = np.fromiter(map(self.slot.__getitem__, request_ids), dtype=np.int64, count=len(request_ids))
        return torch.from_numpy(self.rows[group][slots, : int(self.lens[slots].max())])

    def _grow(self, slots: int, width: int) -> None:
        old = len(self.lens)
        grown = [np.full((slots, width), pad, dtype=np.int64) for pad in self.pads]
        for new, rows in zip(grown, self.rows):
            new[:old, : rows.shape[1]] = rows
        self.rows, self.width = grown, width
        self.lens = np.concatenate([self.lens, np.zeros(slots - old, dtype=np.int64)])
        self.free.extend(range(slots - 1, old - 1, -1))


class CacheManager:
    """Owns the paged KV cache and decides, all or nothing, whether a request's next tokens fit.

    Storage is one key and one value tensor per layer, shaped ``[(num_blocks + 2) * block_size, kv_heads,
    head_dim]``: slot ``b * block_size + i`` holds token ``i`` of block ``b``. The last two blocks are the
    pool's reserved padding blocks, kept zeroed so that padded reads see finite values. `commit_pages`: on
    CPU, every page of the storage is written once here (see `EngineConfig.commit_cache`).

    With `prefix_caching`, each completed block is content-hashed, the hash chained over the whole prefix
    (so equal blocks at different prefixes never collide); a request admitted later whose tokens start with
    hashed blocks takes them instead of computing them again.
    """

    def __init__(
        self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, num_blocks: int,
        dtype: torch.dtype, device: torch.device, groups: list[LayerGroup] | None = None,
        prefix_caching: bool = False, eviction: EvictionPolicy | None = None, commit_pages: bool = False,
    ):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.groups = groups or [LayerGroup("full", tuple(range(num_layers)))]
        self.group_of_layer = [0] * num_layers
        for g, group in enumerate(self.groups):
            for layer in group.layers:
                self.group_of_layer[layer] = g
        self.prefix_caching = prefix_caching and len(self.groups) == 1 and self.groups[0].window is None
        self.sliding = any(group.window is not None for group in self.groups)
        self.pools = [BlockPool(num_blocks, eviction) for _ in self.groups]
        slots = (num_blocks + 2) * block_size
        # Pages are committed as blocks are first written, or all now with `commit_pages`. Reads never go
        # past a request's written tokens except into the zeroed padding blocks.
        # Indexed [slot, kv head, dim] but stored head-major ([kv head, slot, dim] underneath): a gather of
        # many slots for one head then copies into a layout batched matmuls take as they are.
        # One tensor per layer and kind: a single tensor for all of them made batch-1 decode steps ~40% slower
        # (measured, cause not found), though it let new blocks be zeroed in one call.
        self.keys, self.values = (
            [_storage((num_kv_heads, slots, head_dim), dtype, device, commit_pages).transpose(0, 1) for _ in range(num_layers)]
            for _ in range(2)
        )
        pad = slice(num_blocks * block_size, slots)
        for t in self.keys + self.values:
            t[pad].zero_()
        self.padding_slot = num_blocks * block_size
        self._tables: dict[str, list[list[int]]] = {}
        self.rows = TableRows([pool.padding_block for pool in self.pools])
        self._unzeroed: list[list[int]] = [[] for _ in self.groups]  # per group, see `take_new_blocks`
        self._hashes: dict[str, list[int]] = {}  # chained hashes of each request's completed blocks

    # -- the narrow view a scheduler sees ------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (free, or cached and demotable)."""
        if len(self.pools) == 1:
            return self.pools[0].num_free
        return min(pool.num_free for pool in self.pools)

    @property
    def num_cached_blocks(self) -> int:
        """Of `num_free_blocks`, those cached (content kept for prefix hits, evictable), in the same pool."""
        pool = min(self.pools, key=lambda p: p.num_free)
        return pool.num_cached

    def blocks_held(self, request_id: str) -> int:
        """Blocks a request holds (in its largest group: what preempting it frees where it matters most)."""
        tables = self._tables.get(request_id)
        if not tables:
            return 0
        return max(sum(b != pool.padding_block for b in table) for pool, table in zip(self.pools, tables))

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New blocks a request needs so that `num_tokens` tokens in all fit in its cache."""
        tables = self._tables.get(request_id)
        return max(0, -(-num_tokens // self.block_size) - (len(tables[0]) if tables else 0))

    def reserve(self, request_id: str, num_tokens: int) -> bool:
        """Grow a request's tables to hold `num_tokens` tokens in every group, or change nothing and say no."""
        # (at every step for a sixteenth of the decodes, at block_size 16: `blocks_needed` inlined, no generator)
        tables = self._tables.get(request_id)
        held = len(tables[0]) if tables else 0
        need = -(-num_tokens // self.block_size) - held
        if need <= 0:
            return True
        for pool in self.pools:
            if pool.num_free < need:
                return False
        if tables is None:
            tables = self._tables[request_id] = [[] for _ in self.groups]
        for pool, table, unzeroed in zip(self.pools, tables, self._unzeroed):
            fresh = pool.allocate(need)
            unzeroed.extend(fresh)
            table.extend(fresh)
        self.rows.write(request_id, tables, held)
        return True

    def take_new_blocks(self) -> list[list[int]]:
        """The blocks handed out by `reserve` since the last call (per group), to be zeroed by `zero_blocks`
        before anything reads or writes them. A step takes them when it is prepared and zeroes them on the
        forward thread as its forward starts: a fill that large on the event loop's thread is parallel torch
        work there, and it leaves that thread an OpenMP team, which slows every forward after it (see
        `kernels/native.py`)."""
        taken, self._unzeroed = self._unzeroed, [[] for _ in self.groups]
        return taken

    def zero_blocks(self, blocks: list[list[int]]) -> None:
        """Zero blocks (per group, as `take_new_blocks` gives them), one fill per layer for all of them.

        Attention reads whole blocks, and the slots a request has not written yet must hold finite values
        (masked, they weigh nothing; uninitialised memory may be NaN). Zeroing at each `reserve` instead cost
        60 fills per request crossing a block boundary: 15,000 in one step when 256 requests do it together."""
        for g, group_blocks in enumerate(blocks):
            if not group_blocks:
                continue
            ids = torch.tensor(group_blocks, device=self.keys[0].device)
            for layer in self.groups[g].layers:
                for store in (self.keys[layer], self.values[layer]):
                    blocks_view(store, self.block_size).index_fill_(1, ids, 0.0)

    def zero_new_blocks(self) -> None:
        """Zero the blocks not taken by a step yet, at once: before a block copy or a swap-in writes into them
        (zeroed after, what they wrote would be lost)."""
        self.zero_blocks(self.take_new_blocks())

    def match_prefix(self, seq: Sequence) -> int:
        """Give a request that holds no blocks yet the cached blocks holding the start of its tokens; set and
        return its computed tokens. At least one token is always left to compute, so its next token has
        logits to come from. `release` undoes it if the request then does not start."""
        if not self.prefix_caching or seq.request_id in self._tables:
            return 0
        pool, bs = self.pools[0], self.block_size
        hashes, blocks = [], []
        for h in block_hashes(seq.tokens(0, seq.num_tokens - 1), bs):
            block = pool.lookup(h)
            if block is None:
                break
            hashes.append(h)
            blocks.append(block)
        for block in blocks:
            pool.take(block)
        if blocks:
            self._tables[seq.request_id] = [blocks]
            self._hashes[seq.request_id] = hashes
            self.rows.write(seq.request_id, [blocks])
        seq.num_computed = len(blocks) * bs
        return seq.num_computed

    def commit(self, seq: Sequence) -> None:
        """Hash the blocks that the request's computed tokens have completed, so later requests can reuse them."""
        if not self.prefix_caching:
            return
        hashes = self._hashes.setdefault(seq.request_id, [])
        bs = self.block_size
        if seq.num_computed // bs == len(hashes):
            return
        table, pool = self._tables[seq.request_id][0], self.pools[0]
        prev = hashes[-1] if hashes else 0
        for i in range(len(hashes), seq.num_computed // bs):
            parent = prev if i else None
            prev = hash((prev, tuple(seq.tokens(i * bs, (i + 1) * bs))))
            hashes.append(prev)
            pool.register(table[i], prev, parent)

    def slide(self, request_id: str, num_computed: int) -> None:
        """Give back the blocks of sliding-window groups that no later query can see: every position up to
        ``num_computed - window`` is out of reach of the tokens still to come."""
        tables = self._tables.get(request_id)
        if tables is None:
            return
        slid = False
        for group, pool, table in zip(self.groups, self.pools, tables):
            if group.window is None:
                continue
            for i in range(max(0, (num_computed - group.window + 1) // self.block_size)):
                if table[i] != pool.padding_block:
                    pool.free([table[i]])
                    table[i] = pool.padding_block
                    slid = True
        if slid:
            self.rows.write(request_id, tables)

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> bool:
        """Give `child_id` the parent's cache for its first `num_tokens` tokens: full blocks are shared, the
        partial last block is copied (each sample writes its own tokens there). False if no block is free."""
        full, partial = divmod(num_tokens, self.block_size)
        if partial and any(pool.num_free < 1 for pool in self.pools):
            return False
        tables = []
        for g, (pool, table) in enumerate(zip(self.pools, self._tables[parent_id])):
            for block in table[:full]:
                if block != pool.padding_block:
                    pool.share(block)
            mine = table[:full]
            if partial:
                (copy,) = pool.allocate(1)
                self._copy_block(g, table[full], copy)
                mine = mine + [copy]
            tables.append(mine)
        self._tables[child_id] = tables
        self.rows.write(child_id, tables)
        if self.prefix_caching:
            self._hashes[child_id] = self._hashes.get(parent_id, [])[:full]
        return True

    def _copy_block(self, group: int, src: int, dst: int) -> None:
        self.zero_new_blocks()  # `dst` may be a block reserved earlier, released and not zeroed yet
        bs = self.block_size
        for layer in self.groups[group].layers:
            for store in (self.keys[layer], self.values[layer]):
                store[dst * bs : (dst + 1) * bs] = store[src * bs : (src + 1) * bs]

    # -- used by the engine and the attention backend -------------------------------------------------------

    def release(self, request_id: str) -> None:
        """Return every block of a request (finish, abort, failure, soft reset, or a prefix match for a request
        that did not start); hashed ones stay cached."""
        tables = self._tables.pop(request_id, None)
        self._hashes.pop(request_id, None)
        self.rows.drop(request_id)
        if tables is not None:
            for pool, table in zip(self.pools, tables):
                pool.free([b for b in table if b != pool.padding_block])

    def block_table(self, request_id: str, group: int) -> list[int]:
        return self._tables[request_id][group]

    def block_tables(self, request_ids: list[str], group: int) -> list[list[int]]:
        tables = self._tables
        return [tables[r][group] for r in request_ids]

    def block_table_tensor(self, request_ids: list[str], group: int) -> torch.Tensor:
        """[requests, longest table] int64 on the CPU: the requests' block tables in `group`, padded with its
        padding block (what `int_table` makes of `block_tables`, without building it from lists)."""
        return self.rows.gather(request_ids, group)

    def holds(self, request_id: str) -> bool:
        return request_id in self._tables

    @property
    def blocks_demoted(self) -> int:
        return sum(pool.demoted for pool in self.pools)

    @property
    def bytes_allocated(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)
