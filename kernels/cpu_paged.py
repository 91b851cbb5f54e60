"""The CPU backend: decode rows and prefill chunks through C++ kernels (`kernels/native.py`) that read K/V in
place through the block tables (no gather copy, only each row's own context, causal keys only)."""

from __future__ import annotations

import itertools

import torch

from jitney.kernels import native
from jitney.kernels.base import StepInputs, int_tensor
from jitney.kernels.torch_paged import TorchPagedAttention, _TorchStep


class CpuPagedAttention(TorchPagedAttention):
    """fp32 attention reading the cache (fp32, bf16 or int8) in place; the K/V writes as `TorchPagedAttention`. Its
    kernels read only the positions of each request's context, so new blocks need no zeroing (which took ~3% of
    the forward thread's time on mixed-64)."""

    reads_unwritten_slots = False
    # fp32 queries over bf16 K/V (`EngineConfig.kv_cache_dtype`), widened exactly as they are read, or over int8
    # rows, each code times its row's scale
    cache_dtypes = frozenset({torch.bfloat16, torch.int8})
    # Each row's sums in an order fixed by its own context (a decode's by the decode kernel, a prompt's rows by the
    # prefill kernel however the prompt is chunked: see `StepExecutor._mixed_rows`).
    batch_invariant = True

    def __init__(self):
        self.kernel = native.load()

    def prepare(self, step: StepInputs) -> "_CpuStep":
        return _CpuStep(step, self.kernel)


class _CpuStep(_TorchStep):
    def __init__(self, step: StepInputs, kernel):
        self.kernel = kernel
        super().__init__(step)

    def _init_decode(self, step: StepInputs) -> None:
        nd = self.nd
        self.dec_tables = [t[:nd].contiguous() for t in step.block_tables]
        self.dec_ctx = step.context_tensor[:nd].contiguous()

    def _init_prefill(self, step: StepInputs) -> None:
        nd = self.nd
        lens = step.query_lens[nd:]
        self.pre_tables = [t[nd:].contiguous() for t in step.block_tables]
        self.pre_ctx = step.context_tensor[nd:].contiguous()
        self.pre_qlens = int_tensor(lens, self.pre_ctx.device)
        self.pre_starts = int_tensor([0, *itertools.accumulate(lens)][:-1], self.pre_ctx.device)

    def _decode(self, g, kc, vc, q, scaling, sliding_window, softcap=None, sinks=None) -> torch.Tensor:
        if q.dtype != torch.float32:
            raise NotImplementedError("the CPU attention kernel is fp32 only; use attention_backend='torch'")
        out = q.new_empty(q.shape[1], q.shape[0], q.shape[2])
        # the cache is stored head-major: its transpose is contiguous
        self.kernel.paged_decode(q.transpose(0, 1).contiguous(), kc.transpose(0, 1), vc.transpose(0, 1),
                                 self.dec_tables[g], self.dec_ctx, out, scaling, sliding_window or 0, self.block_size,
                                 softcap or 0.0, _fp32(sinks))
        return out

    def _prefill(self, g, kc, vc, q, key, value, scaling, sliding_window, softcap=None, sinks=None) -> torch.Tensor:
        if q.dtype != torch.float32:
            raise NotImplementedError("the CPU attention kernel is fp32 only; use attention_backend='torch'")
        qp = q[:, self.nd :].transpose(0, 1).contiguous()  # [T - nd, H, D]
        out = torch.empty_like(qp)
        self.kernel.paged_prefill(qp, kc.transpose(0, 1), vc.transpose(0, 1), self.pre_tables[g], self.pre_ctx,
                                  self.pre_qlens, self.pre_starts, out, scaling, sliding_window or 0, self.block_size,
                                  softcap or 0.0, _fp32(sinks))
        return out


def _fp32(sinks: torch.Tensor | None) -> torch.Tensor | None:
    """Sinks as the kernels take them (a model's own may be of another dtype)."""
    return None if sinks is None else sinks.detach().float().contiguous()
