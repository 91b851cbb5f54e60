// Part of the kernels' one translation unit: cpu_kernels.cpp includes the parts in order, each using those
// before it. This one: RMSNorm, rotary, the gated MLP's activation and argmax.
#pragma once

// Rows per parallel task for elementwise kernels: enough work per task that small steps stay on one thread.
static int64_t row_grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

// RMSNorm of t rows of width c: out = w * s / sqrt(mean(s^2) + eps), s = x (+ residual, then also written to sum).
static void rms_rows(const float* xp, const float* rp, const float* wp, double eps, int64_t t, int64_t c, float* op,
                     float* sp, bool small) {
  parallel(t, row_grain(c), small, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * c;
      float ss = 0.f;
      if (rp) {
        float* sr = sp + r * c;
        const float* rr = rp + r * c;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < c; ++i) {
          sr[i] = xr[i] + rr[i];
          ss += sr[i] * sr[i];
        }
        xr = sr;
      } else {
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < c; ++i) ss += xr[i] * xr[i];
      }
      const float inv = 1.f / std::sqrt(ss / (float)c + (float)eps);
      float* o = op + r * c;
#pragma omp simd
      for (int64_t i = 0; i < c; ++i) o[i] = wp[i] * (xr[i] * inv);
    }
  });
}

// RMSNorm of each row of x ([T, C]). With `residual`, the row normalised is x + residual, which is returned too
// (the decoder layer's residual stream); without, the second result is x.
std::vector<torch::Tensor> rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor w, double eps) {
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat,
              "rms_norm: contiguous fp32 inputs");
  auto out = torch::empty_like(x);
  torch::Tensor sum = x;
  const float* rp = nullptr;
  if (residual.has_value()) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes(), "rms_norm: residual shaped as x");
    sum = torch::empty_like(x);
    rp = residual->data_ptr<float>();
  }
  rms_rows(x.data_ptr<float>(), rp, w.data_ptr<float>(), eps, x.size(0), x.size(1), out.data_ptr<float>(),
           sum.data_ptr<float>(), false);
  return {out, sum};
}

// Rotary embedding in place on the first `heads` heads (of d each) of t rows, `stride` floats apart: the first
// and second halves of each head turn by the row's angles (cos/sin [t, d], halves repeated).
static void rotary_rows(float* xp, int64_t t, int64_t stride, const float* cp, const float* sp, int64_t d, int64_t heads,
                        bool small) {
  const int64_t half = d / 2;
  parallel(t, row_grain(heads * d), small, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cp + r * d;
      const float* s = sp + r * d;
      for (int64_t h = 0; h < heads; ++h) {
        float* a = xp + r * stride + h * d;
        float* b = a + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = a[i], x2 = b[i];
          a[i] = x1 * c[i] - x2 * s[i];
          b[i] = x2 * c[half + i] + x1 * s[half + i];
        }
      }
    }
  });
}

// RMSNorm of the queries and keys, in place, before the rotary embedding: of each of the m rows of y (`stride`
// floats apart), the first q_width floats (the queries) in parts of dq with weight `qw`, the next k_width (the
// keys) in parts of dk with `kw`; `rms_rows`'s arithmetic over each part. Parts of a head (Qwen3's and Gemma3's
// q_norm and k_norm) or of all heads at once (OLMo2's).
static void head_norm_rows(float* y, int64_t m, int64_t stride, int64_t q_width, int64_t dq, const float* qw, int64_t k_width,
                           int64_t dk, const float* kw, double eps, bool small) {
  parallel(m, 1, small, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t start = 0; start < q_width + k_width;) {
        const bool query = start < q_width;
        const int64_t d = query ? dq : dk;
        const float* w = query ? qw : kw;
        float* x = y + r * stride + start;
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t j = 0; j < d; ++j) ss += x[j] * x[j];
        const float inv = 1.f / std::sqrt(ss / (float)d + (float)eps);
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) x[j] = w[j] * (x[j] * inv);
        start += d;
      }
  });
}

// `head_norm_rows` on x ([T, >= q_width + k_width], rows contiguous), in place: the queries in parts of
// qw.numel(), the keys in parts of kw.numel() (each width a whole number of parts).
void head_norm_(torch::Tensor x, int64_t q_width, int64_t k_width, torch::Tensor qw, torch::Tensor kw, double eps) {
  const int64_t dq = qw.numel(), dk = kw.numel();
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == torch::kFloat && qw.is_contiguous() &&
              kw.is_contiguous() && qw.scalar_type() == torch::kFloat && kw.scalar_type() == torch::kFloat && dq > 0 &&
              dk > 0 && q_width % dq == 0 && k_width % dk == 0 && q_width + k_width <= x.size(1),
              "head_norm_: fp32 rows, query and key widths whole parts of their weights");
  head_norm_rows(x.data_ptr<float>(), x.size(0), x.stride(0), q_width, dq, qw.data_ptr<float>(), k_width, dk,
                 kw.data_ptr<float>(), eps, false);
}

// Rotary position embedding, in place, on the first `heads` heads of each row of x ([T, >= heads * D]).
void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads) {
  TORCH_CHECK(x.stride(1) == 1 && cos.is_contiguous() && sin.is_contiguous() && x.scalar_type() == torch::kFloat &&
              cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat, "rotary_: fp32 rows, contiguous angles");
  const int64_t t = x.size(0), d = cos.size(-1);
  TORCH_CHECK(cos.numel() == t * d && sin.numel() == t * d && heads * d <= x.size(1),
              "rotary_: one angle row per token, heads * head_dim columns");
  rotary_rows(x.data_ptr<float>(), t, x.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(), d, heads, false);
}

// The gated MLP's activation on t rows: [2n] (gate then up) -> [n], act(gate) * up (`Activation`).
static void gated_rows(const float* gp, int64_t t, int64_t n, float* op, bool small, int64_t act) {
  parallel(t, row_grain(n), small, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) gate_times_up(gp + r * 2 * n, gp + r * 2 * n + n, n, op + r * n, act);
  });
}

torch::Tensor gated_act(torch::Tensor gu, int64_t act) {
  TORCH_CHECK(gu.is_contiguous() && gu.scalar_type() == torch::kFloat && gu.size(1) % 2 == 0, "gated_act: contiguous fp32 [T, 2I]");
  TORCH_CHECK(act == SILU || act == GELU_TANH, "gated_act: activation 0 (SiLU) or 1 (GeLU, tanh)");
  const int64_t t = gu.size(0), n = gu.size(1) / 2;
  auto out = torch::empty({t, n}, gu.options());
  gated_rows(gu.data_ptr<float>(), t, n, out.data_ptr<float>(), false, act);
  return out;
}

// torch.argmax of one row: the first index of the largest value, the first NaN if there is one.
static inline bool is_nan(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return (bits & 0x7fffffffu) > 0x7f800000u;
}

static int64_t argmax_scalar(const float* row, int64_t begin, int64_t n, int64_t best) {
  for (int64_t i = begin; i < n; ++i) {
    if (is_nan(row[i])) return i;
    if (row[i] > row[best]) best = i;
  }
  return best;
}

// Eight lanes each keep their largest value and its first index; the lanes' winner is the largest value at
// the smallest index; a NaN anywhere sends the row to the scalar loop (which finds the first). A row of 49,152
// floats (SmolLM2's vocabulary): ~11.5 us, against ~224 one by one.
static int64_t argmax_row(const float* row, int64_t n) {
  if (n < 16) return argmax_scalar(row, 0, n, 0);
  v8 top = load8(row);
  i8 at = {0, 1, 2, 3, 4, 5, 6, 7}, cur = at, nan{};
  const i8 abs_mask = i8{} + 0x7fffffff, inf = i8{} + 0x7f800000;
  i8 bits;
  std::memcpy(&bits, &top, 32);
  nan |= (bits & abs_mask) > inf;
  int64_t i = 8;
  for (; i + 8 <= n; i += 8) {
    const v8 v = load8(row + i);
    cur += 8;
    std::memcpy(&bits, &v, 32);
    nan |= (bits & abs_mask) > inf;
    const i8 more = v > top;
    top = more ? v : top;
    at = more ? cur : at;
  }
  for (int l = 0; l < 8; ++l)
    if (nan[l]) return argmax_scalar(row, 0, n, 0);
  int64_t best = at[0];
  for (int l = 1; l < 8; ++l)
    if (top[l] > row[best] || (top[l] == row[best] && at[l] < best)) best = at[l];
  return argmax_scalar(row, i, n, best);
}

// The index of each row's largest value ([M, N] fp32 -> M ints), like torch.argmax (`argmax_row`); one thread
// per row, on the pool for one or two rows. torch's own argmax of a large row is an OpenMP-parallel reduction,
// and its team's threads then spin on the second core while the pool's worker needs it: the next batch-1
// step's layers ran ~3 ms slower after it.
std::vector<int64_t> argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == torch::kFloat, "argmax_rows: fp32 rows");
  const int64_t m = x.size(0), n = x.size(1), stride = x.stride(0);
  const float* xp = x.data_ptr<float>();
  std::vector<int64_t> out(m, 0);
  parallel(m, 1, m <= 2, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = argmax_row(xp + r * stride, n);
  });
  return out;
}
