"""The attention backends against dense attention, on random ragged steps (Triton in its CPU interpreter)."""

from __future__ import annotations

import math

import pytest
import torch

from jitney.cache.manager import CacheManager
from jitney.kernels.base import StepInputs
from jitney.kernels.torch_paged import TorchPagedAttention


def dense(q, k, v, qpos, window, softcap=None, sinks=None):
    """Reference: q [H, n, D] at absolute positions `qpos` over k/v [KVH, L, D] of one sequence; soft-capping
    and sinks ([H]) as transformers' Gemma2 and GPT-OSS eager attention compute them."""
    heads, kvh = q.shape[0], k.shape[0]
    k, v = k.repeat_interleave(heads // kvh, 0), v.repeat_interleave(heads // kvh, 0)
    scores = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    kpos = torch.arange(k.shape[1])
    allowed = kpos[None, :] <= qpos[:, None]
    if window is not None:
        allowed &= kpos[None, :] > qpos[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, -1) @ v  # [H, n, D]
    sink = sinks[:, None, None].expand(heads, len(qpos), 1)
    return torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1] @ v


def triton_backend():
    from jitney.kernels.triton_paged import TritonPagedAttention

    return TritonPagedAttention()


def cpu_backend():
    from jitney.kernels.cpu_paged import CpuPagedAttention

    return CpuPagedAttention()


@pytest.mark.parametrize("backend", [TorchPagedAttention, triton_backend, cpu_backend])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_matches_dense(backend, block_size, heads, kv_heads, window):
    # (cached tokens, new tokens): decodes first, then prefill chunks, some continuing a cached prefix,
    # one longer than a Triton query tile.
    check_against_dense(backend, block_size, heads, kv_heads, window, 8, [(5, 1), (17, 1), (0, 1), (0, 9), (6, 3), (13, 7), (2, 21)])


@pytest.mark.parametrize("dim", [36, 40, 64])
@pytest.mark.parametrize("window", [None, 20])
def test_cpu_prefill_over_many_key_groups_matches_dense(dim, window):
    """Chunks that span several groups of 16 keys, head sizes that are not a multiple of 16 (or of the
    decode kernel's 8-wide vectors), SmolLM2's head grouping (9 query heads on 3 KV heads)."""
    check_against_dense(cpu_backend, 16, 9, 3, window, dim, [(30, 1), (0, 70), (45, 38), (100, 5)])


@pytest.mark.parametrize("dim", [16, 80, 128])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("window", [None, 20])
def test_cpu_decode_over_head_sizes_and_groups_matches_dense(dim, heads, kv_heads, window):
    """Decode rows through the CPU kernel's 16-wide path (where the CPU has 512-bit vectors): head sizes of
    one, five (four and one) and eight vectors, groups of one, four and six query heads a KV head, contexts
    of one position to several groups of 16, and a window."""
    check_against_dense(cpu_backend, 16, heads, kv_heads, window, dim, [(0, 1), (15, 1), (16, 1), (40, 1), (100, 1), (3, 2)])


@pytest.mark.parametrize("backend", [TorchPagedAttention, triton_backend, cpu_backend])
@pytest.mark.parametrize("softcap, sinks", [(1.0, False), (None, True), (2.0, True)], ids=["softcap", "sinks", "both"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dim", [8, 64])
def test_soft_capping_and_sinks_match_dense(backend, softcap, sinks, window, dim):
    """Gemma2's soft-capping and GPT-OSS's attention sinks on decode rows and prefill chunks (64: the CPU
    kernels' 16-wide paths)."""
    sink_logits = torch.randn(4) * 2 if sinks else None
    check_against_dense(backend, 4, 4, 2, window, dim, [(5, 1), (17, 1), (0, 1), (0, 9), (13, 7), (2, 21)],
                        softcap=softcap, sinks=sink_logits)


@pytest.mark.parametrize("dim", [8, 36, 64])
@pytest.mark.parametrize("window", [None, 5])
def test_cpu_kernels_over_a_bf16_cache(dim, window):
    """A bf16 cache (`EngineConfig.kv_cache_dtype`) under fp32 queries: decode rows and prefill chunks (head sizes of
    the 8-wide, odd and 16-wide paths) match dense attention over the keys and values rounded as the cache holds
    them, and equal the kernels over an fp32 cache of those rounded values bit for bit (each element widened
    exactly, then the same sums)."""
    shapes = [(5, 1), (17, 1), (0, 1), (40, 1), (0, 9), (6, 3), (13, 21), (30, 40)]
    torch.manual_seed(dim)
    narrow = check_against_dense(cpu_backend, 4, 6, 2, window, dim, shapes, cache_dtype=torch.bfloat16)
    torch.manual_seed(dim)
    wide = check_against_dense(cpu_backend, 4, 6, 2, window, dim, shapes, round_to=torch.bfloat16)
    assert torch.equal(narrow, wide)


def check_against_dense(backend, block_size, heads, kv_heads, window, dim, shapes, softcap=None, sinks=None,
                        cache_dtype=torch.float32, round_to=None):
    """The step's output; `cache_dtype`: the cache's (given fp32 keys and values, which it rounds as it stores them);
    `round_to`: the keys and values given already rounded to it (both: dense attention over the rounded ones)."""
    # Fresh random inputs each run unless the caller seeds them.
    cache = CacheManager(1, kv_heads, dim, block_size, 64, cache_dtype, torch.device("cpu"))
    for store in cache.keys + cache.values:  # poison every slot no request writes
        store[: 64 * block_size] = float("nan")
    attention = backend()
    zeroed = getattr(attention, "reads_unwritten_slots", True)  # else the poison stays: such a backend never reads it
    rounding = round_to or (cache_dtype if cache_dtype != torch.float32 else None)
    held = (lambda t: t.to(rounding).float()) if rounding else (lambda t: t)  # what the cache holds
    given = held if round_to else (lambda t: t)
    full_k = [given(torch.randn(kv_heads, c + n, dim)) for c, n in shapes]
    full_v = [given(torch.randn(kv_heads, c + n, dim)) for c, n in shapes]
    for i, (c, n) in enumerate(shapes):
        assert cache.reserve(str(i), c + n)
        blocks = cache.take_new_blocks()
        if zeroed:
            cache.zero_blocks(blocks)  # as a step's forward does before anything writes them
        if c:  # earlier steps wrote the cached part
            slots = torch.tensor([cache.block_table(str(i), 0)[p // block_size] * block_size + p % block_size for p in range(c)])
            cache.keys[0][slots] = full_k[i][:, :c].transpose(0, 1).to(cache_dtype)
            cache.values[0][slots] = full_v[i][:, :c].transpose(0, 1).to(cache_dtype)
    tables = [cache.block_table(str(i), 0) for i in range(len(shapes))]
    width = max(map(len, tables))
    decodes = next(i for i, (_, n) in enumerate(shapes) if n > 1)  # the rows of one new token come first
    step = StepInputs(
        query_lens=[n for _, n in shapes], context_lens=[c + n for c, n in shapes], num_decodes=decodes,
        positions=torch.cat([torch.arange(c, c + n) for c, n in shapes]),
        block_tables=[torch.tensor([t + [64] * (width - len(t)) for t in tables])], group_of_layer=[0],
        block_size=block_size, padding_slot=cache.padding_slot, keys=cache.keys, values=cache.values,
    )
    q = torch.randn(1, heads, step.positions.numel(), dim)
    k = torch.cat([fk[:, c:] for fk, (c, _) in zip(full_k, shapes)], 1)[None]
    v = torch.cat([fv[:, c:] for fv, (c, _) in zip(full_v, shapes)], 1)[None]
    features = {name: f for name, f in (("softcap", softcap), ("sinks", sinks)) if f is not None}
    out = attention.prepare(step)(0, q, k, v, dim ** -0.5, window, **features)
    assert out.shape == (1, step.positions.numel(), heads, dim)
    row = 0
    for i, (c, n) in enumerate(shapes):
        want = dense(q[0, :, row : row + n], held(full_k[i]), held(full_v[i]), torch.arange(c, c + n), window, softcap, sinks)
        torch.testing.assert_close(out[0, row : row + n].transpose(0, 1), want, atol=1e-5, rtol=1e-5)
        row += n
    return out


@pytest.mark.parametrize("dim, heads, kv_heads", [(64, 9, 3), (16, 4, 4), (80, 8, 2)])
@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_rows_of_one_request_equal_each_row_alone(dim, heads, kv_heads, window, dtype):
    """A checking pass gives a request's token and its guesses as rows of consecutive positions over one block
    table, which the decode kernel takes in one task a head (their keys read once from memory): each row's
    output is bit for bit what the row gives alone, beside rows of other requests and a request's rows that
    are not consecutive positions."""
    from jitney.kernels import native

    if not native.available():
        pytest.skip("the decode kernel is jitney's C++")
    kernel = native.load()
    torch.manual_seed(dim + window)
    block_size, slots = 16, 64 * 16
    k = torch.randn(kv_heads, slots, dim).to(dtype)
    v = torch.randn(kv_heads, slots, dim).to(dtype)
    tables = [torch.randperm(64)[:12] for _ in range(3)]
    # request 0: 3 rows; request 1: 1; request 2: 2 rows, then 2 more at positions that do not follow on
    rows = [(0, 40), (0, 41), (0, 42), (1, 150), (2, 7), (2, 8), (2, 30), (2, 33)]
    table = torch.stack([tables[r] for r, _ in rows]).contiguous()
    ctx = torch.tensor([c for _, c in rows])
    q = torch.randn(len(rows), heads, dim)
    together = torch.empty_like(q)
    kernel.paged_decode(q, k, v, table, ctx, together, dim ** -0.5, window, block_size, 0.0, None)
    for i in range(len(rows)):
        alone = torch.empty_like(q[i : i + 1])
        kernel.paged_decode(q[i : i + 1].contiguous(), k, v, table[i : i + 1].contiguous(), ctx[i : i + 1], alone,
                            dim ** -0.5, window, block_size, 0.0, None)
        assert torch.equal(together[i], alone[0]), rows[i]
