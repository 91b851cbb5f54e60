"""Triton paged attention: one kernel for decode rows, one for chunked (varlen) prefill, both reading K/V
through block tables, with grouped-query attention and sliding windows.

On CPU the kernels run under ``TRITON_INTERPRET=1`` (the tests do), on NVIDIA GPUs compiled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jitney.kernels.base import StepInputs


@triton.jit
def _attend_block(q, acc, m_i, l_i, k_ptr, v_ptr, table_ptr, j, qpos, kmax, kvh, scale, window, softcap,
                  stride_s, stride_h, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  HAS_SOFTCAP: tl.constexpr):
    """Online-softmax update of `acc` with cache block `j` of a request (q: [ROWS, D], qpos: [ROWS]).
    Slots past `kmax`, the last key any row may see, are never read: they may hold anything."""
    block = tl.load(table_ptr + j)
    offs_n = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = block * BLOCK + offs_n
    kpos = j * BLOCK + offs_n
    written = (kpos <= kmax)[:, None]
    k = tl.load(k_ptr + rows[:, None] * stride_s + kvh * stride_h + offs_d[None, :], mask=written, other=0.0)
    v = tl.load(v_ptr + rows[:, None] * stride_s + kvh * stride_h + offs_d[None, :], mask=written, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # fp32 stays fp32 (no TF32)
    if HAS_SOFTCAP:  # softcap * tanh(s / softcap), tanh through exp: the interpreter has no libdevice
        e = tl.exp(-2.0 * tl.abs(s) / softcap)
        s = tl.where(s < 0, -softcap, softcap) * (1.0 - e) / (1.0 + e)
    allowed = kpos[None, :] <= qpos[:, None]
    if HAS_WINDOW:
        allowed = allowed & (kpos[None, :] > qpos[:, None] - window)
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def _sink_start(sinks_ptr, heads, live, l_i):
    """The online softmax's state before any key where each head has a sink: one key seen, at the sink's logit,
    of weight exp(0) and no value."""
    return tl.load(sinks_ptr + heads, mask=live, other=0.0), l_i + 1.0


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, ctx_ptr, scale, window,
                   stride_qt, stride_qh, stride_s, stride_h, stride_tab, sinks_ptr, softcap, GROUP: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_WINDOW: tl.constexpr,
                   HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr):
    """One program per (decode row, KV head): the row's GROUP query heads attend over its whole context."""
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    ctx = tl.load(ctx_ptr + row)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + offs_g
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=offs_g[:, None] < GROUP, other=0.0)
    qpos = tl.zeros([BLOCK_G], dtype=tl.int32) + ctx - 1
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    if HAS_SINKS:
        m_i, l_i = _sink_start(sinks_ptr, heads, offs_g < GROUP, l_i)
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(ctx - window, 0) // BLOCK
    for j in range(first, tl.cdiv(ctx, BLOCK)):
        acc, m_i, l_i = _attend_block(q, acc, m_i, l_i, k_ptr, v_ptr, tables_ptr + row * stride_tab, j, qpos, ctx - 1, kvh,
                                      scale, window, softcap, stride_s, stride_h, BLOCK, HEAD_DIM, HAS_WINDOW, HAS_SOFTCAP)
    acc = acc / l_i[:, None]
    tl.store(out_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], acc, mask=offs_g[:, None] < GROUP)


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, tile_req_ptr, tile_row_ptr, tile_len_ptr, tile_pos_ptr,
                    scale, window, stride_qt, stride_qh, stride_s, stride_h, stride_tab, sinks_ptr, softcap,
                    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
                    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr):
    """One program per (tile of up to BLOCK_M query rows of one chunk, query head): causal attention over the
    request's cache, which already holds this step's keys."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kvh = head // GROUP
    req = tl.load(tile_req_ptr + tile)
    first_row = tl.load(tile_row_ptr + tile)
    n = tl.load(tile_len_ptr + tile)
    pos0 = tl.load(tile_pos_ptr + tile)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    live = offs_m < n
    rows = first_row + offs_m
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=live[:, None], other=0.0)
    qpos = pos0 + tl.where(live, offs_m, 0)  # padding rows repeat the first row's position: never empty
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:
        m_i, l_i = _sink_start(sinks_ptr, tl.zeros([BLOCK_M], dtype=tl.int32) + head, live, l_i)
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(pos0 - window + 1, 0) // BLOCK
    for j in range(first, tl.cdiv(pos0 + n, BLOCK)):
        acc, m_i, l_i = _attend_block(q, acc, m_i, l_i, k_ptr, v_ptr, tables_ptr + req * stride_tab, j, qpos, pos0 + n - 1, kvh,
                                      scale, window, softcap, stride_s, stride_h, BLOCK, HEAD_DIM, HAS_WINDOW, HAS_SOFTCAP)
    acc = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], acc, mask=live[:, None])


class TritonPagedAttention:
    """The Triton backend: the same contract as the torch reference (`jitney.kernels.base.StepAttention`)."""

    static_steps = True  # works on StepInputs.static steps (CUDA graphs)
    # Each row's blocks in the same order through the same `_attend_block` in both kernels: bit-identical alone or
    # in a crowd as measured in Triton's CPU interpreter (tests/test_batch_invariance.py); never measured on a GPU,
    # where `EngineConfig.batch_invariant` is refused.
    batch_invariant = True

    block_m = 16

    def prepare(self, step: StepInputs) -> "_TritonStep":
        return _TritonStep(step, self.block_m)


class _TritonStep:
    supports = frozenset({"softcap", "sinks"})

    def __init__(self, step: StepInputs, block_m: int):
        self.keys, self.values, self.group_of_layer = step.keys, step.values, step.group_of_layer
        self.block_size = step.block_size
        device = step.positions.device
        self.nd = step.num_decodes
        starts = [0]
        for q in step.query_lens:
            starts.append(starts[-1] + q)
        self.tables = [t.to(torch.int32).contiguous() for t in step.block_tables]
        self.write_slots = step.write_slots
        self.decode_ctx = step.context_tensor[: self.nd].to(torch.int32)
        tiles = []  # (request, first row, rows, position of the first row)
        for r in range(self.nd, len(step.query_lens)):
            q, ctx = step.query_lens[r], step.context_lens[r]
            for off in range(0, q, block_m):
                tiles.append((r, starts[r] + off, min(block_m, q - off), ctx - q + off))
        # (no tiles in a static step: nothing here may copy from the host during a graph capture)
        self.tile_req, self.tile_row, self.tile_len, self.tile_pos = (
            torch.tensor(c, dtype=torch.int32, device=device) for c in zip(*tiles)) if tiles else (None,) * 4
        self.block_m = block_m

    def __call__(self, layer, query, key, value, scaling, sliding_window, *, softcap=None, sinks=None):
        g = self.group_of_layer[layer]
        kc, vc = self.keys[layer], self.values[layer]
        kc.index_copy_(0, self.write_slots[g], key[0].transpose(0, 1))
        vc.index_copy_(0, self.write_slots[g], value[0].transpose(0, 1))
        q = query[0].transpose(0, 1).contiguous()  # [T, H, D]
        heads, dim = q.shape[1], q.shape[2]
        kvh = kc.shape[1]
        group = heads // kvh
        out = torch.full_like(q, float("nan"))  # poisoned: a row no kernel wrote shows up at once
        window = sliding_window if sliding_window is not None else 0
        table = self.tables[g]
        common = dict(BLOCK=self.block_size, HEAD_DIM=dim, HAS_WINDOW=sliding_window is not None,
                      HAS_SOFTCAP=softcap is not None, softcap=softcap or 1.0, HAS_SINKS=sinks is not None,
                      sinks_ptr=q if sinks is None else sinks.detach().float().contiguous())  # (q: never read)
        if self.nd:
            _decode_kernel[(self.nd, kvh)](
                q, kc, vc, out, table, self.decode_ctx, scaling, window, q.stride(0), q.stride(1), kc.stride(0),
                kc.stride(1), table.stride(0), GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), **common)
        if self.tile_req is not None:
            _prefill_kernel[(self.tile_req.numel(), heads)](
                q, kc, vc, out, table, self.tile_req, self.tile_row, self.tile_len, self.tile_pos, scaling, window,
                q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), table.stride(0), GROUP=group,
                BLOCK_M=self.block_m, **common)
        return out.unsqueeze(0)
