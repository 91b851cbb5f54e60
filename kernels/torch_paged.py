"""The torch reference backend: paged attention with batched SDPA calls, no per-request loop per layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from jitney.kernels.base import StepInputs


class TorchPagedAttention:
    """Per layer: one scatter of the new K/V into the cache, one SDPA call over every decode row (query
    heads grouped under their KV head), and one SDPA call over the prefill chunks padded to a rectangle."""

    static_steps = True  # works on StepInputs.static steps (CUDA graphs)

    def prepare(self, step: StepInputs) -> "_TorchStep":
        return _TorchStep(step)


def _slots(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of `positions` ([R, L]) in each row's block table ([R, max_blocks])."""
    blocks = torch.gather(table, 1, torch.div(positions, block_size, rounding_mode="floor"))
    return blocks * block_size + positions % block_size


class _TorchStep:
    def __init__(self, step: StepInputs):
        self.keys, self.values = step.keys, step.values
        self.group_of_layer = step.group_of_layer
        bs, pad = step.block_size, step.padding_slot
        device = step.positions.device
        qlens = torch.tensor(step.query_lens, device=device)
        ctx = step.context_tensor
        nd = self.nd = step.num_decodes
        self.T = sum(step.query_lens)
        tables = step.block_tables
        self.write_slots = step.write_slots
        self._masks: dict[tuple[str, int | None], torch.Tensor] = {}
        self._buffers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

        if nd:  # decode rows: [nd, Ld] context slots, reads past each context go to the padding slot
            # A static step reads its whole (padded) tables: its lengths are not known on the host.
            ld = tables[0].shape[1] * bs if step.static else max(step.context_lens[:nd])
            pos = torch.arange(ld, device=device).expand(nd, ld)
            self.dec_valid = pos < ctx[:nd, None]
            self.dec_pos, self.dec_last = pos, ctx[:nd, None] - 1
            self.dec_read = [torch.where(self.dec_valid, _slots(t[:nd], pos.clamp(max=t.shape[1] * bs - 1), bs), pad).view(-1) for t in tables]
            self.ld = ld

        np_ = len(qlens) - nd
        self.np = np_
        if np_:
            pq, pctx = qlens[nd:], ctx[nd:]
            self.qmax, self.lp = max(step.query_lens[nd:]), max(step.context_lens[nd:])
            starts = torch.cumsum(qlens, 0)[nd:] - pq  # first row of each chunk in the flat batch
            i = torch.arange(self.qmax, device=device)
            clipped = torch.minimum(i[None, :], pq[:, None] - 1)  # padding query rows repeat the chunk's last row
            self.pre_rows = (starts[:, None] + clipped).view(-1)
            self.pre_qpos = pctx[:, None] - pq[:, None] + clipped  # [P, qmax] absolute positions
            self.pre_unpad = (torch.arange(np_, device=device)[:, None] * self.qmax + i[None, :])[i[None, :] < pq[:, None]]
            kpos = torch.arange(self.lp, device=device).expand(np_, self.lp)
            self.pre_kpos = kpos
            valid = kpos < pctx[:, None]
            self.pre_read = [torch.where(valid, _slots(t[nd:], kpos.clamp(max=t.shape[1] * bs - 1), bs), pad).view(-1) for t in tables]
            # A single chunk that starts a prompt attends only to itself: plain causal attention, no gather.
            self.fresh = np_ == 1 and step.context_lens[nd] == step.query_lens[nd]

    def _gather(self, kind: str, kc: torch.Tensor, vc: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the context rows out of the cache into buffers made once per step and reused by every layer
        (allocating them per layer costs more than the copy)."""
        bufs = self._buffers.get(kind)
        if bufs is None:
            bufs = self._buffers[kind] = (kc.new_empty((rows.numel(), *kc.shape[1:])), vc.new_empty((rows.numel(), *vc.shape[1:])))
        torch.index_select(kc, 0, rows, out=bufs[0])
        torch.index_select(vc, 0, rows, out=bufs[1])
        return bufs

    def _mask(self, kind: str, window: int | None) -> torch.Tensor:
        """Boolean attention mask (True = attend), built once per step per window size."""
        key = (kind, window)
        if key not in self._masks:
            if kind == "decode":
                m = self.dec_valid
                if window is not None:
                    m = m & (self.dec_pos > self.dec_last - window)
                m = m[:, None, None, :]
            else:
                qpos = self.pre_qpos[:, :, None]
                kpos = self.pre_kpos[:, None, :]
                m = kpos <= qpos
                if window is not None:
                    m = m & (kpos > qpos - window)
                m = m[:, None]
            self._masks[key] = m
        return self._masks[key]

    def __call__(self, layer, query, key, value, scaling, sliding_window):
        g = self.group_of_layer[layer]
        kc, vc = self.keys[layer], self.values[layer]
        # [1, KVH, T, D] -> [T, KVH, D] is a view of transformers' own layout, so this copy is contiguous.
        k_new, v_new = key[0].transpose(0, 1), value[0].transpose(0, 1)
        kc.index_copy_(0, self.write_slots[g], k_new)
        vc.index_copy_(0, self.write_slots[g], v_new)
        q = query[0]  # [H, T, D]
        heads, _, dim = q.shape
        kvh = kc.shape[1]
        out = torch.empty(self.T, heads, dim, dtype=q.dtype, device=q.device)

        if self.nd:
            nd, ld = self.nd, self.ld
            qd = q[:, :nd].transpose(0, 1).reshape(nd, kvh, heads // kvh, dim)
            kd, vd = self._gather("decode", kc, vc, self.dec_read[g])
            kd, vd = kd.view(nd, ld, kvh, dim).transpose(1, 2), vd.view(nd, ld, kvh, dim).transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=self._mask("decode", sliding_window), scale=scaling)
            out[:nd] = od.view(nd, heads, dim)

        if self.np:
            np_, qmax, lp = self.np, self.qmax, self.lp
            if self.fresh and sliding_window is None:
                qp = q[:, self.nd :].unsqueeze(0)
                kp = key[:, :, self.nd :]
                vp = value[:, :, self.nd :]
                op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scaling, enable_gqa=heads != kvh)
                out[self.nd :] = op[0].transpose(0, 1)
            else:
                qp = q.index_select(1, self.pre_rows).view(heads, np_, qmax, dim).transpose(0, 1)
                kp, vp = self._gather("prefill", kc, vc, self.pre_read[g])
                kp, vp = kp.view(np_, lp, kvh, dim).transpose(1, 2), vp.view(np_, lp, kvh, dim).transpose(1, 2)
                op = F.scaled_dot_product_attention(
                    qp, kp, vp, attn_mask=self._mask("prefill", sliding_window), scale=scaling, enable_gqa=heads != kvh
                )
                out[self.nd :] = op.transpose(1, 2).reshape(np_ * qmax, heads, dim).index_select(0, self.pre_unpad)
        return out.unsqueeze(0)
