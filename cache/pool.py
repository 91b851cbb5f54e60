"""The block pool: which KV-cache blocks are free."""

from __future__ import annotations


class BlockPool:
    """Hands out block ids ``0 .. num_blocks-1``; ids ``num_blocks`` and ``num_blocks+1`` are reserved.

    The two reserved blocks are never allocated: padding tokens read from and write to them, so a padded
    step never touches a live request's cache.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1 (got {num_blocks})")
        self.num_blocks = num_blocks
        self.padding_block = num_blocks
        # A stack: the most recently freed block is reused first, while its memory is still warm.
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        taken = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        return taken

    def free(self, ids: list[int]) -> None:
        self._free.extend(ids)
