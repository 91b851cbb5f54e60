"""The CPU backend: decode rows through a C++ kernel (`kernels/native.py`) that reads K/V in place through
the block tables (no gather copy, only each row's own context); prefill chunks as in the torch backend."""

from __future__ import annotations

import torch

from jitney.kernels import native
from jitney.kernels.base import StepInputs
from jitney.kernels.torch_paged import TorchPagedAttention, _TorchStep


class CpuPagedAttention(TorchPagedAttention):
    """fp32 decode rows read the cache in place; everything else as `TorchPagedAttention`."""

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

    def _decode(self, g, kc, vc, q, scaling, sliding_window) -> torch.Tensor:
        if q.dtype != torch.float32:
            raise NotImplementedError("the CPU attention kernel is fp32 only; use attention_backend='torch'")
        out = q.new_empty(q.shape[1], q.shape[0], q.shape[2])
        # the cache is stored head-major: its transpose is contiguous
        self.kernel.paged_decode(q.transpose(0, 1).contiguous(), kc.transpose(0, 1), vc.transpose(0, 1),
                                 self.dec_tables[g], self.dec_ctx, out, scaling, sliding_window or 0, self.block_size)
        return out
