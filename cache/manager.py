"""The cache manager: per-layer KV tensors, layer groups, and each request's block table."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jitney.cache.pool import BlockPool


@dataclass(frozen=True)
class LayerGroup:
    """Layers that share block ids: a request holds one block table per group."""

    name: str
    layers: tuple[int, ...]


class CacheManager:
    """Owns the paged KV cache and decides, all or nothing, whether a request's next tokens fit.

    Storage is one key and one value tensor per layer, shaped ``[(num_blocks + 2) * block_size, kv_heads,
    head_dim]``: slot ``b * block_size + i`` holds token ``i`` of block ``b``. The last two blocks are the
    pool's reserved padding blocks, kept zeroed so that padded reads see finite values.
    """

    def __init__(
        self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, num_blocks: int,
        dtype: torch.dtype, device: torch.device, groups: list[LayerGroup] | None = None,
    ):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.groups = groups or [LayerGroup("full", tuple(range(num_layers)))]
        self.group_of_layer = [0] * num_layers
        for g, group in enumerate(self.groups):
            for layer in group.layers:
                self.group_of_layer[layer] = g
        self.pools = [BlockPool(num_blocks) for _ in self.groups]
        slots = (num_blocks + 2) * block_size
        # torch.empty: pages are committed only as blocks are first written. Reads never go past a
        # request's written tokens except into the zeroed padding blocks.
        self.keys = [torch.empty(slots, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.empty_like(k) for k in self.keys]
        pad = slice(num_blocks * block_size, slots)
        for t in self.keys + self.values:
            t[pad].zero_()
        self.padding_slot = num_blocks * block_size
        self._tables: dict[str, list[list[int]]] = {}

    # -- the narrow view a scheduler sees ------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return min(pool.num_free for pool in self.pools)

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New blocks a request needs so that `num_tokens` tokens in all fit in its cache."""
        return max(0, -(-num_tokens // self.block_size) - self.blocks_held(request_id))

    def blocks_held(self, request_id: str) -> int:
        tables = self._tables.get(request_id)
        return len(tables[0]) if tables else 0

    def reserve(self, request_id: str, num_tokens: int) -> bool:
        """Grow a request's tables to hold `num_tokens` tokens in every group, or change nothing and say no."""
        need = self.blocks_needed(request_id, num_tokens)
        if need == 0:
            return True
        if any(pool.num_free < need for pool in self.pools):
            return False
        tables = self._tables.setdefault(request_id, [[] for _ in self.groups])
        for pool, table in zip(self.pools, tables):
            table.extend(pool.allocate(need))
        return True

    # -- used by the engine and the attention backend -------------------------------------------------------

    def release(self, request_id: str) -> None:
        """Return every block of a request to the pool (finish, abort, failure, soft reset)."""
        tables = self._tables.pop(request_id, None)
        if tables is not None:
            for pool, table in zip(self.pools, tables):
                pool.free(table)

    def block_table(self, request_id: str, group: int) -> list[int]:
        return self._tables[request_id][group]

    def holds(self, request_id: str) -> bool:
        return request_id in self._tables

    @property
    def bytes_allocated(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)
