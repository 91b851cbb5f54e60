"""The CPU backend: decode rows through a small C++ kernel that reads K/V in place through the block tables
(no gather copy, only each row's own context), prefill chunks as in the torch backend.

The kernel is compiled once with the machine's C++ compiler (`torch.utils.cpp_extension`, into
``<jitney cache>/kernels``; `jitney setup` builds it ahead); where that fails, the engine falls back to
the torch backend.
"""

from __future__ import annotations

import logging

import torch

from jitney.kernels.base import StepInputs
from jitney.kernels.torch_paged import TorchPagedAttention, _TorchStep

log = logging.getLogger("jitney")

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

// One decode row per (row, KV head) task: its `group` query heads attend over positions
// [first, ctx) of the row's context, read through its block table from the head-major cache.
void paged_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor tables, torch::Tensor ctx,
                  torch::Tensor out, double scale, int64_t window, int64_t block_size) {
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && tables.is_contiguous() && ctx.is_contiguous(),
              "paged_decode: contiguous inputs, head-major cache");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && tables.scalar_type() == torch::kLong && ctx.scalar_type() == torch::kLong,
              "paged_decode: fp32 queries and cache, int64 tables and lengths");
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k.size(0), slots = k.size(1), width = tables.size(1);
  const int64_t group = heads / kv_heads;
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* cp = ctx.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(group * dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / kv_heads, h = task % kv_heads;
      const int64_t len = std::min(cp[r], width * block_size);
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      scores.assign(group * n, 0.f);
      const float* q0 = qp + (r * heads + h * group) * dim;
      const float* kh = kp + h * slots * dim;
      const float* vh = vp + h * slots * dim;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t pos = first + i;
        const float* kr = kh + (tp[r * width + pos / block_size] * block_size + pos % block_size) * dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = q0 + g * dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < dim; ++d) s += qg[d] * kr[d];
          scores[g * n + i] = s * (float)scale;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::vector<float> total(group, 0.f);
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * n;
        const float m = *std::max_element(sg, sg + n);
        for (int64_t i = 0; i < n; ++i) {
          sg[i] = std::exp(sg[i] - m);
          total[g] += sg[i];
        }
      }
      for (int64_t i = 0; i < n; ++i) {
        const int64_t pos = first + i;
        const float* vr = vh + (tp[r * width + pos / block_size] * block_size + pos % block_size) * dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * n + i];
          float* ag = acc.data() + g * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) ag[d] += p * vr[d];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* o = op + (r * heads + h * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] = acc[g * dim + d] / total[g];
      }
    }
  });
}
"""

_module = None


def load():
    """Compile (once per machine and source) and load the kernel; raises where it cannot be built."""
    global _module
    if _module is None:
        from torch.utils.cpp_extension import load_inline

        from jitney.core.models import cache_dir

        build = cache_dir() / "kernels" / "cpu_paged"
        build.mkdir(parents=True, exist_ok=True)
        _module = load_inline(
            "jitney_cpu_paged", cpp_sources=_SOURCE, functions=["paged_decode"], build_directory=str(build),
            extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
        )
    return _module


def available() -> bool:
    """Whether the kernel builds and loads here (logged once when it does not)."""
    try:
        load()
        return True
    except Exception as exc:  # no compiler, no headers, ...
        log.warning("jitney's CPU attention kernel could not be built (%s); using the torch backend", exc)
        return False


class CpuPagedAttention(TorchPagedAttention):
    """fp32 decode rows read the cache in place; everything else as `TorchPagedAttention`."""

    def __init__(self):
        self.kernel = load()

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
