"""Solve for the number of KV-cache blocks that fits in free memory."""

from __future__ import annotations

import torch


def available_memory(device: torch.device) -> int:
    """Bytes free for the cache: free device memory on CUDA, available RAM on CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read available memory; pass EngineConfig(num_blocks=...)")


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Keys and values of one block across every layer."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def step_overhead_bytes(
    max_batch_tokens: int, max_requests: int, hidden_size: int, intermediate_size: int, vocab_size: int,
    num_heads: int, dtype: torch.dtype,
) -> int:
    """Memory one step needs besides the cache: activations of `max_batch_tokens`, logits, index tensors."""
    activations = max_batch_tokens * (4 * hidden_size + 3 * intermediate_size + 2 * num_heads * 64)
    logits = max_requests * vocab_size * 2  # logits plus a sampling copy
    index_tensors = max_batch_tokens * 8 * 4
    return (activations + logits) * dtype.itemsize + index_tensors


def solve_num_blocks(
    per_block: int, overhead: int, memory_percent: float, device: torch.device, most_useful: int | None = None,
    cap: int | None = None,
) -> int:
    """Largest block count whose cache plus one step's overhead fits under `memory_percent` of free memory,
    capped at `most_useful` (what every request of a full batch at the model's whole context would hold: more
    could never be used, and each block costs some bookkeeping) and at `cap` bytes of cache."""
    budget = int(available_memory(device) * memory_percent) - overhead
    n = budget // per_block - 2  # two blocks are reserved for padding
    if cap is not None and n > cap // per_block - 2:
        n = max(1, cap // per_block - 2)
    if most_useful is not None and n > most_useful:
        return most_useful
    if n < 1:
        raise RuntimeError(
            f"not enough free memory for a KV cache: {budget / 2**20:.0f} MiB left after a step's overhead; "
            "lower max_batch_tokens or pass num_blocks"
        )
    return n


def check_committable(per_block: int, num_blocks: int, device: torch.device) -> None:
    """Raise `ValueError` where a cache of `num_blocks` (and the two padding blocks) is larger than the memory
    available now: committing its pages would have the process killed rather than raise."""
    need, free = per_block * (num_blocks + 2), available_memory(device)
    if need > free:
        raise ValueError(
            f"EngineConfig.num_blocks={num_blocks}: the cache needs {need / 2**30:.1f} GiB and {free / 2**30:.1f} GiB "
            "is available; lower num_blocks, or pass commit_cache=False to commit its pages only as they are used"
        )
