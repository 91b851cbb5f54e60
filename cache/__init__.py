"""The paged KV cache: block pool, layer groups, block tables and sizing."""

from jitney.cache.manager import CacheManager, LayerGroup
from jitney.cache.pool import BlockPool

__all__ = ["BlockPool", "CacheManager", "LayerGroup"]
