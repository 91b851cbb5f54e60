"""What an engine holds in memory, by part (`Engine.memory()`; `jitney bench` prints it for each jitney run): the
model's own weights, jitney's packed copies of them, the speculative draft, the LM head's screen and the KV cache.
Counted by storage, each once, in the first part that holds it, so a packed "copy" that is the model's own tensor
(a bf16 screen over a bf16 head) costs nothing more."""

from __future__ import annotations

from collections.abc import Iterable

import msgspec
import torch


class MemoryUse(msgspec.Struct, frozen=True, kw_only=True):
    """Bytes an engine holds, by part."""

    weights: int
    """The model's own parameters (a tied head and embedding once) that it still holds: not the weights its packed
    copies hold instead of it (`cpu_linear.release`)."""
    packed: int
    """jitney's packed copies of the linear layers and the LM head (`EngineConfig.pack_cpu_weights`, `weights`,
    `compute`): instead of the model's own weights where they hold them exactly (every decoder layer's linears but
    rounded ones: int8, or bf16 from fp32), beside them where not (those, the LM head)."""
    draft: int
    """The int8 self-draft of speculative decoding (0 where speculation is off: it is packed only when used)."""
    screen: int
    """The LM head's int8 screen for greedy rows (`EngineConfig.lm_head_screen`)."""
    kv_reserved: int
    """The KV cache's tensors (committed as first written unless `EngineConfig.commit_cache`)."""
    kv_in_use: int
    """The KV blocks requests hold now (in the layer group where they hold most; blocks that only cache a prefix
    are not counted: they are given up as soon as a request needs them)."""

    @property
    def total(self) -> int:
        """Every part but the KV in use (which is inside the reserved)."""
        return self.weights + self.packed + self.draft + self.screen + self.kv_reserved

    def describe(self) -> str:
        """One line, in MiB."""
        mib = {name: getattr(self, name) / 2**20 for name in self.__struct_fields__}
        return ("weights {weights:,.0f} MiB, packed {packed:,.0f}, draft {draft:,.0f}, screen {screen:,.0f}, "
                "KV reserved {kv_reserved:,.0f} (in use {kv_in_use:,.0f})").format(**mib)


def storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int]) -> int:
    """Bytes of the storages of `tensors` not in `seen` (their addresses, which this adds to)."""
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def memory_use(model, paths: list, cache) -> MemoryUse:
    """What an engine over `model` holds: its entered CPU `paths` (`assembly.enter_cpu_paths`; the one-call
    decoder's draft and screen with them) and its `cache` (`CacheManager`)."""
    decoder = next((p.decoder for p in paths if getattr(p, "decoder", None) is not None), None)
    seen: set[int] = set()
    weights = storage_bytes(model.parameters(), seen)
    packed = storage_bytes((t for path in paths for t in path.tensors), seen)
    draft = storage_bytes(decoder.draft_tensors, seen) if decoder is not None else 0
    screen = storage_bytes(decoder.screen_tensors, seen) if decoder is not None else 0
    per_block = cache.bytes_allocated // (cache.num_blocks + 2)  # (two padding blocks)
    return MemoryUse(weights=weights, packed=packed, draft=draft, screen=screen, kv_reserved=cache.bytes_allocated,
                     kv_in_use=(cache.num_blocks - cache.num_free_blocks) * per_block)
