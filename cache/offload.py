"""Offload backends: where the KV blocks of a preempted request wait until the cache has room again."""

from __future__ import annotations

from typing import Protocol

import torch

from jitney.cache.manager import CacheManager
from jitney.core.config import EngineConfig
from jitney.core.hooks import hookimpl

Tables = list[list[int]]  # block ids per layer group


class OffloadBackend(Protocol):
    """Registered with ``jitney_register_offload_backends`` as ``factory(config, cache)``, selected by
    ``EngineConfig(offload_backend=name)``; a factory may return None when the config disables it.

    The engine calls `store` once per step with every request it offloads in that step (so a backend can
    move them in one batched copy), `load` when a request comes back, `discard` when an offloaded request
    ends (aborted) without coming back.
    """

    def free_blocks(self) -> int:
        """Blocks (per layer group) that `store` can still take."""

    def store(self, cache: CacheManager, tables: dict[str, Tables]) -> None:
        """Copy each request's blocks out of the cache; the caller frees the cache blocks afterwards."""

    def load(self, cache: CacheManager, request_id: str, tables: Tables) -> None:
        """Copy a stored request's blocks back into the freshly allocated cache blocks `tables`, and forget it."""

    def discard(self, request_id: str) -> None:
        """Forget a stored request."""


class CpuSwapPool:
    """A pre-allocated host-memory pool of `cpu_offload_space` GiB (pinned when the cache is on CUDA), cut
    into blocks like the cache. Every request offloaded in one step moves in one gather + scatter per layer."""

    def __init__(self, config: EngineConfig, cache: CacheManager):
        bs = cache.block_size
        k0 = cache.keys[0]
        per_block = 2 * len(cache.keys) * bs * k0.shape[1] * k0.shape[2] * k0.element_size()
        self.num_blocks = int(config.cpu_offload_space * 2**30) // per_block
        if self.num_blocks < 1:
            raise ValueError(f"cpu_offload_space={config.cpu_offload_space} GiB holds no block of {per_block} bytes")
        pin = k0.device.type == "cuda"
        shape = (self.num_blocks * bs, k0.shape[1], k0.shape[2])
        self.keys = [torch.empty(shape, dtype=k0.dtype, pin_memory=pin) for _ in cache.keys]
        self.values = [torch.empty(shape, dtype=k0.dtype, pin_memory=pin) for _ in cache.keys]
        self.block_size = bs
        self._free = [list(range(self.num_blocks - 1, -1, -1)) for _ in cache.groups]
        self._held: dict[str, Tables] = {}

    def free_blocks(self) -> int:
        return min(len(free) for free in self._free)

    def _rows(self, blocks: list[int]) -> torch.Tensor:
        bs = self.block_size
        return (torch.tensor(blocks)[:, None] * bs + torch.arange(bs)).view(-1)

    def store(self, cache: CacheManager, tables: dict[str, Tables]) -> None:
        src: list[list[int]] = [[] for _ in cache.groups]
        dst: list[list[int]] = [[] for _ in cache.groups]
        for request_id, per_group in tables.items():
            mine = []
            for g, blocks in enumerate(per_group):
                taken = [self._free[g].pop() for _ in blocks]
                src[g] += blocks
                dst[g] += taken
                mine.append(taken)
            self._held[request_id] = mine
        self._copy(cache, src, dst, to_host=True)

    def load(self, cache: CacheManager, request_id: str, tables: Tables) -> None:
        held = self._held.pop(request_id)
        self._copy(cache, tables, held, to_host=False)
        for g, blocks in enumerate(held):
            self._free[g].extend(blocks)

    def discard(self, request_id: str) -> None:
        for g, blocks in enumerate(self._held.pop(request_id, [])):
            self._free[g].extend(blocks)

    def _copy(self, cache: CacheManager, cache_side: Tables, host_side: Tables, to_host: bool) -> None:
        """Move whole blocks between the cache and this pool: one index_select + index_copy per layer."""
        if not to_host:
            cache.zero_new_blocks()  # the blocks written here were just reserved: zero them first, not after
        for g, group in enumerate(cache.groups):
            if not cache_side[g]:
                continue
            dev_rows = self._rows(cache_side[g]).to(cache.keys[0].device)
            host_rows = self._rows(host_side[g])
            for layer in group.layers:
                for dev, host in ((cache.keys[layer], self.keys[layer]), (cache.values[layer], self.values[layer])):
                    if to_host:
                        host.index_copy_(0, host_rows, dev.index_select(0, dev_rows).cpu())
                    else:
                        dev.index_copy_(0, dev_rows, host.index_select(0, host_rows).to(dev.device))


@hookimpl
def jitney_register_offload_backends(register):
    register("cpu", lambda config, cache: CpuSwapPool(config, cache) if config.cpu_offload_space > 0 else None)
