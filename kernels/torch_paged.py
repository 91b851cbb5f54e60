"""The torch reference backend: paged attention with batched SDPA calls, no per-request loop per layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from jitney.cache.manager import blocks_view
from jitney.kernels.base import StepInputs, cache_rows, int_tensor


class TorchPagedAttention:
    """Per layer: one scatter of the new K/V into the cache, two batched matmuls over every decode row (query
    heads grouped under their KV head), and one SDPA call over the prefill chunks padded to a rectangle.

    `rowwise` (`EngineConfig.batch_invariant`): instead, each query row attends alone, in fp32, over exactly its
    own context. The batched calls' sums run in orders that depend on the other rows (the padded widths, the
    number of rows): a row's output differed by ~1e-7 in fp32, ~4e-3 in bf16. Rowwise it cannot: the same
    calls on the same shapes whatever else the step holds, and no different path for decodes and prefills."""

    static_steps = True  # works on StepInputs.static steps (CUDA graphs)

    def __init__(self, rowwise: bool = False):
        self.batch_invariant = rowwise
        """Whether each row's output is independent of the rest of the batch (see `AttentionBackend`)."""

    def prepare(self, step: StepInputs) -> "_TorchStep | _RowStep":
        return _RowStep(step) if self.batch_invariant else _TorchStep(step)


class _TorchStep:
    supports = frozenset({"softcap", "sinks"})

    def __init__(self, step: StepInputs):
        self.keys, self.values = step.keys, step.values
        self.group_of_layer = step.group_of_layer
        self.block_size = step.block_size
        nd = self.nd = step.num_decodes
        self.T = sum(step.query_lens)
        self.write_slots = step.write_slots
        self._masks: dict[tuple[str, int | None], torch.Tensor] = {}
        self._buffers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

        if nd:
            self._init_decode(step)

        self.np = len(step.query_lens) - nd
        if self.np:  # (a static step has none: nothing here may copy from the host during a graph capture)
            self._init_prefill(step)

    def _init_prefill(self, step: StepInputs) -> None:
        nd, np_, bs, device = self.nd, self.np, self.block_size, step.positions.device
        qlens = int_tensor(step.query_lens, device)
        pq, pctx = qlens[nd:], step.context_tensor[nd:]
        wp = -(-max(step.context_lens[nd:]) // bs)
        self.qmax, self.lp = max(step.query_lens[nd:]), wp * bs
        starts = torch.cumsum(qlens, 0)[nd:] - pq  # first row of each chunk in the flat batch
        i = torch.arange(self.qmax, device=device)
        clipped = torch.minimum(i[None, :], pq[:, None] - 1)  # padding query rows repeat the chunk's last row
        self.pre_rows = (starts[:, None] + clipped).view(-1)
        self.pre_qpos = pctx[:, None] - pq[:, None] + clipped  # [P, qmax] absolute positions
        self.pre_unpad = (torch.arange(np_, device=device)[:, None] * self.qmax + i[None, :])[i[None, :] < pq[:, None]]
        self.pre_kpos = torch.arange(self.lp, device=device).expand(np_, self.lp)
        self.pre_blocks = [t[nd:, :wp].reshape(-1) for t in step.block_tables]
        # A single chunk that starts a prompt attends only to itself: plain causal attention, no gather.
        self.fresh = np_ == 1 and step.context_lens[nd] == step.query_lens[nd]

    def _init_decode(self, step: StepInputs) -> None:
        # Contexts are gathered block by block (whole blocks of each table, padding blocks included), so a
        # row's Ld keys are its table's width in blocks times the block size; the mask hides the rest.
        # A static step reads its whole padded tables: its lengths are on the device only.
        nd, bs, tables, ctx = self.nd, self.block_size, step.block_tables, step.context_tensor
        wd = tables[0].shape[1] if step.static else -(-max(step.context_lens[:nd]) // bs)
        self.dec_blocks = [t[:nd, :wd].reshape(-1) for t in tables]
        ld = self.ld = wd * bs
        pos = torch.arange(ld, device=ctx.device).expand(nd, ld)
        self.dec_valid = pos < ctx[:nd, None]
        self.dec_pos, self.dec_last = pos, ctx[:nd, None] - 1

    def _gather(self, kind: str, kc: torch.Tensor, vc: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy whole blocks out of the cache (stored head-major: each head's block is one contiguous run),
        as [kv_heads, blocks * block_size, head_dim], into buffers made once per step and reused by every
        layer (allocating them per layer costs more than the copy)."""
        bufs = self._buffers.get(kind)
        kvh, dim = kc.shape[1], kc.shape[2]
        if bufs is None:
            shape = (kvh, blocks.numel(), self.block_size * dim)
            bufs = self._buffers[kind] = (kc.new_empty(shape), vc.new_empty(shape))
        torch.index_select(blocks_view(kc, self.block_size), 1, blocks, out=bufs[0])
        torch.index_select(blocks_view(vc, self.block_size), 1, blocks, out=bufs[1])
        return bufs[0].view(kvh, -1, dim), bufs[1].view(kvh, -1, dim)

    def _mask(self, kind: str, window: int | None) -> torch.Tensor:
        """Boolean attention mask (True = attend), built once per step per window size."""
        key = (kind, window)
        if key not in self._masks:
            if kind == "decode":  # True where masked out, [rows, 1, L]
                m = self.dec_valid
                if window is not None:
                    m = m & (self.dec_pos > self.dec_last - window)
                m = ~m[:, None, :]
            else:
                qpos = self.pre_qpos[:, :, None]
                kpos = self.pre_kpos[:, None, :]
                m = kpos <= qpos
                if window is not None:
                    m = m & (kpos > qpos - window)
                m = m[:, None]
            self._masks[key] = m
        return self._masks[key]

    def __call__(self, layer, query, key, value, scaling, sliding_window, *, softcap=None, sinks=None):
        g = self.group_of_layer[layer]
        kc, vc = self.keys[layer], self.values[layer]
        # [1, KVH, T, D] -> [T, KVH, D] is a view of transformers' own layout, so this copy is contiguous.
        k_new, v_new = key[0].transpose(0, 1), value[0].transpose(0, 1)
        # (a cache of another dtype, `EngineConfig.kv_cache_dtype`, holds them rounded, or as int8 rows)
        kc.index_copy_(0, self.write_slots[g], cache_rows(k_new, kc.dtype))
        vc.index_copy_(0, self.write_slots[g], cache_rows(v_new, vc.dtype))
        q = query[0]  # [H, T, D]
        if not self.np:  # decode rows only
            return self._decode(g, kc, vc, q, scaling, sliding_window, softcap, sinks).unsqueeze(0)
        out = torch.empty(self.T, q.shape[0], q.shape[2], dtype=q.dtype, device=q.device)
        if self.nd:
            out[: self.nd] = self._decode(g, kc, vc, q[:, : self.nd], scaling, sliding_window, softcap, sinks)
        if self.np:
            out[self.nd :] = self._prefill(g, kc, vc, q, key, value, scaling, sliding_window, softcap, sinks)
        return out.unsqueeze(0)

    def _decode(self, g, kc, vc, q, scaling, sliding_window, softcap=None, sinks=None) -> torch.Tensor:
        """Decode rows ([H, nd, D] queries) -> [nd, H, D]: batched matmuls over (KV head, row), each row's
        query heads under one KV head against that head's gathered context (SDPA's CPU kernels are slow on
        so few query rows per call)."""
        heads, nd, dim = q.shape
        kvh, ld = kc.shape[1], self.ld
        group = heads // kvh
        qd = (q * scaling).view(kvh, group, nd, dim).transpose(1, 2).reshape(kvh * nd, group, dim)
        kd, vd = self._gather("decode", kc, vc, self.dec_blocks[g])
        scores = torch.bmm(qd, kd.view(kvh * nd, ld, dim).transpose(1, 2))
        if softcap is not None:
            _softcap_(scores, softcap)
        scores.view(kvh, nd, group, ld).masked_fill_(self._mask("decode", sliding_window), float("-inf"))
        weights = _softmax(scores.view(kvh, nd, group, ld), None if sinks is None else sinks.view(kvh, 1, group, 1))
        od = torch.bmm(weights.reshape(kvh * nd, group, ld), vd.view(kvh * nd, ld, dim))
        return od.view(kvh, nd, group, dim).permute(1, 0, 2, 3).reshape(nd, heads, dim)

    def _prefill(self, g, kc, vc, q, key, value, scaling, sliding_window, softcap=None, sinks=None) -> torch.Tensor:
        """Prefill chunks (rows after the decodes of `q`, [H, T, D]) -> [T - nd, H, D]."""
        heads, _, dim = q.shape
        kvh = kc.shape[1]
        np_, qmax, lp = self.np, self.qmax, self.lp
        plain = softcap is None and sinks is None  # what SDPA computes
        if self.fresh and sliding_window is None and plain:
            qp = q[:, self.nd :].unsqueeze(0)
            kp = key[:, :, self.nd :]
            vp = value[:, :, self.nd :]
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scaling, enable_gqa=heads != kvh)
            return op[0].transpose(0, 1)
        qp = q.index_select(1, self.pre_rows).view(heads, np_, qmax, dim).transpose(0, 1)
        kp, vp = self._gather("prefill", kc, vc, self.pre_blocks[g])
        kp, vp = kp.view(kvh, np_, lp, dim).transpose(0, 1), vp.view(kvh, np_, lp, dim).transpose(0, 1)
        mask = self._mask("prefill", sliding_window)
        if plain:
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scaling, enable_gqa=heads != kvh)
        else:
            op = _attend(qp, kp, vp, mask, scaling, softcap, sinks)
        return op.transpose(1, 2).reshape(np_ * qmax, heads, dim).index_select(0, self.pre_unpad)


class _RowStep:
    """`TorchPagedAttention(rowwise=True)`'s step: one query row at a time over the cache slots of its context."""

    supports = frozenset({"softcap", "sinks"})

    def __init__(self, step: StepInputs):
        self.keys, self.values, self.group_of_layer = step.keys, step.values, step.group_of_layer
        self.write_slots = step.write_slots
        self.tables, self.block_size = step.block_tables, step.block_size
        # per query row: its request's row of the block tables and the length of its context (itself included)
        self.rows = [(r, c - n + 1 + i) for r, (n, c) in enumerate(zip(step.query_lens, step.context_lens)) for i in range(n)]
        self._slots: dict[tuple[int, int | None], list[torch.Tensor]] = {}

    def slots(self, g: int, window: int | None) -> list[torch.Tensor]:
        """Per query row, the cache slots of the keys it sees (built once per step per group and window)."""
        key = (g, window)
        if key not in self._slots:
            bs, table = self.block_size, self.tables[g]
            out = []
            for r, length in self.rows:
                pos = torch.arange(0 if window is None else max(0, length - window), length, device=table.device)
                out.append(table[r, pos // bs] * bs + pos % bs)
            self._slots[key] = out
        return self._slots[key]

    def __call__(self, layer, query, key, value, scaling, sliding_window, *, softcap=None, sinks=None):
        g = self.group_of_layer[layer]
        kc, vc = self.keys[layer], self.values[layer]
        kc.index_copy_(0, self.write_slots[g], cache_rows(key[0].transpose(0, 1), kc.dtype))
        vc.index_copy_(0, self.write_slots[g], cache_rows(value[0].transpose(0, 1), vc.dtype))
        heads, t, dim = query.shape[1:]
        kvh = kc.shape[1]
        q = query[0].transpose(0, 1).float().view(t, kvh, heads // kvh, dim) * scaling
        s = None if sinks is None else sinks.float().view(kvh, heads // kvh, 1)
        out = torch.empty(t, heads, dim, dtype=torch.float32, device=query.device)
        for i, slots in enumerate(self.slots(g, sliding_window)):
            k = kc.index_select(0, slots).float().permute(1, 2, 0)  # [kvh, D, L]
            v = vc.index_select(0, slots).float().transpose(0, 1)  # [kvh, L, D]
            scores = q[i] @ k  # [kvh, group, L]
            if softcap is not None:
                _softcap_(scores, softcap)
            out[i] = (_softmax(scores, s) @ v).view(heads, dim)
        return out.to(query.dtype).unsqueeze(0)


def _softcap_(scores: torch.Tensor, softcap: float) -> None:
    """Soft-cap scaled scores in place; before the mask, as transformers' eager attention does."""
    scores.div_(softcap).tanh_().mul_(softcap)


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim; a sink ([..., 1], broadcast over `scores`' rows) joins each row's denominator
    and is dropped after: it takes weight from the keys but adds no value."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sinks = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]


def _attend(q, k, v, allowed, scaling, softcap, sinks) -> torch.Tensor:
    """What SDPA computes (q [P, heads, n, D] over k, v [P, kv_heads, L, D] where `allowed`), with soft-capping
    and sinks, which SDPA has no place for."""
    p, heads, n, dim = q.shape
    kvh, length = k.shape[1], k.shape[2]
    group = heads // kvh
    # a KV head's query heads side by side as one taller query: no copy of K or V per query head
    scores = ((q * scaling).reshape(p, kvh, group * n, dim) @ k.transpose(2, 3)).view(p, heads, n, length)
    if softcap is not None:
        _softcap_(scores, softcap)
    scores.masked_fill_(~allowed, float("-inf"))
    weights = _softmax(scores, None if sinks is None else sinks.view(heads, 1, 1))
    return (weights.reshape(p, kvh, group * n, length) @ v).view(p, heads, n, dim)
