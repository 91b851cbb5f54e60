// Part of the kernels' one translation unit: cpu_kernels.cpp includes the parts in order, each using those
// before it. This one: decode attention over the paged cache (`paged_decode`).
#pragma once

// The scores of HEADS query heads (q, one after another) against P keys (k, one after another), the first
// `dim8` dims in vectors and the rest one by one: P * HEADS independent sums, each key loaded once for all.
template <int P, int HEADS, typename T>
static inline void key_scores(const float* q, const T* k, int64_t dim, int64_t dim8, float scale, float* s, int64_t ld) {
  const int64_t rs = row_of<T>(dim);
  v8 acc[HEADS][P];
  for (int g = 0; g < HEADS; ++g)
    for (int j = 0; j < P; ++j) acc[g][j] = v8{};
  for (int64_t d = 0; d < dim8; d += 8) {
    v8 kv[P];
    for (int j = 0; j < P; ++j) kv[j] = load8(k + j * rs + d);
    for (int g = 0; g < HEADS; ++g) {
      const v8 qv = load8(q + g * dim + d);
      for (int j = 0; j < P; ++j) acc[g][j] = madd(qv, kv[j], acc[g][j]);
    }
  }
  for (int g = 0; g < HEADS; ++g)
    for (int j = 0; j < P; ++j) {
      float sum = hsum(acc[g][j]);
      for (int64_t d = dim8; d < dim; ++d) sum = madd(q[g * dim + d], to_float(k[j * rs + d]), sum);
      s[g * ld + j] = sum * scale * row_scale(k + j * rs, dim);
    }
}

// `key_scores` for all `group` query heads, two at a time.
template <int P, typename T>
static inline void every_head_scores(const float* q, int64_t group, const T* k, int64_t dim, int64_t dim8, float scale,
                                     float* s, int64_t ld) {
  int64_t g = 0;
  for (; g + 2 <= group; g += 2) key_scores<P, 2>(q + g * dim, k, dim, dim8, scale, s + g * ld, ld);
  if (g < group) key_scores<P, 1>(q + g * dim, k, dim, dim8, scale, s + g * ld, ld);
}

// acc[NV] += p_i * v_i over `count` value rows (stride `rs`), NV vectors of dims from v; each p_i times its row's
// scale (s_i, at `dim` past the row's start).
template <int NV, typename T>
static inline void weighted_values(const float* p, const T* v, const T* s, int64_t count, int64_t dim, float* out) {
  const int64_t rs = row_of<T>(dim);
  v8 acc[NV];
  for (int c = 0; c < NV; ++c) acc[c] = load8(out + 8 * c);
  for (int64_t i = 0; i < count; ++i) {
    const float pi = p[i] * row_scale(s + i * rs, dim);
    for (int c = 0; c < NV; ++c) acc[c] = madd(pi, load8(v + i * rs + 8 * c), acc[c]);
  }
  std::memcpy(out, acc, sizeof acc);
}

template <typename T>
static inline void weighted_values_any(int64_t nv, const float* p, const T* v, const T* s, int64_t count, int64_t dim,
                                       float* out) {
  switch (nv) {
    case 8: weighted_values<8>(p, v, s, count, dim, out); break;
    case 7: weighted_values<7>(p, v, s, count, dim, out); break;
    case 6: weighted_values<6>(p, v, s, count, dim, out); break;
    case 5: weighted_values<5>(p, v, s, count, dim, out); break;
    case 4: weighted_values<4>(p, v, s, count, dim, out); break;
    case 3: weighted_values<3>(p, v, s, count, dim, out); break;
    case 2: weighted_values<2>(p, v, s, count, dim, out); break;
    default: weighted_values<1>(p, v, s, count, dim, out); break;
  }
}

// s[i] = exp(s[i] - m) for n scores (m: their largest, so that none overflows); returns their sum (WIDE partial
// sums, lane by lane, then added as `hsum` adds them).
static inline float exp_sum(float* s, int64_t n, float m) {
  vw sum{};
  int64_t i = 0;
  for (; i + WIDE <= n; i += WIDE) {
    const vw e = expw(loadw(s + i) - m);
    storew(s + i, e);
    sum += e;
  }
  if (i < n) {  // the rest in one vector, its unused lanes exp(-inf) = 0
    const vw e = expw(loadw_part(s + i, n - i, -__builtin_inff()) - m);
    storew_part(s + i, e, n - i);
    sum += e;
  }
  return hsum(sum);
}

// `exp_sum` where a head may have a sink (GPT-OSS): a logit that joins the softmax's denominator with no value.
static inline float exp_sum_sink(float* s, int64_t n, float m, const float* sink) {
  if (!sink) return exp_sum(s, n, m);
  m = std::max(m, *sink);
  return exp_sum(s, n, m) + exp1(*sink - m);
}

// Soft-capping of scaled scores (Gemma2): cap * tanh(s / cap), before the mask as in transformers.
static inline void soft_cap(float* s, int64_t n, float cap) {
  for (int64_t i = 0; i < n; ++i) s[i] = cap * tanhf(s[i] / cap);
}

// Attention of decode rows over the paged, head-major cache ([kv_heads, slots, dim] for keys and values).
// One task per (row, KV head): its `group` query heads attend over positions [first, ctx) of the row's
// context, read through its block table. Row r's queries start at q + r * q_stride, heads one after another;
// the output is [rows, heads, dim]. A block's positions lie side by side in the cache, so each task goes
// through its context block by block: keys four at a time against two query heads at a time (each key
// loaded once for both), values with the sums for 64 dims of one head in registers. The blocks themselves
// lie anywhere, which the hardware prefetcher does not follow: the next block's keys (values) are
// prefetched while this block's are read. Where `softcap` > 0 the scores are soft-capped; where `sinks` is
// given (one logit per query head) each head's sink joins its softmax's denominator.
#ifdef __AVX512F__
template <typename T>
static void decode_attention16(const float* qp, int64_t q_stride, int64_t rows, int64_t heads, int64_t dim,
                               const T* kp, const T* vp, int64_t kv_heads, int64_t slots, const int64_t* tp,
                               int64_t width, const int64_t* cp, float* op, double scale, int64_t window,
                               int64_t block_size, bool small, float softcap, const float* sinks);
#endif

template <typename T>
static void decode_attention(const float* qp, int64_t q_stride, int64_t rows, int64_t heads, int64_t dim,
                             const T* kp, const T* vp, int64_t kv_heads, int64_t slots, const int64_t* tp,
                             int64_t width, const int64_t* cp, float* op, double scale, int64_t window,
                             int64_t block_size, bool small, float softcap = 0.f, const float* sinks = nullptr) {
#ifdef __AVX512F__
  if (dim % 16 == 0)
    return decode_attention16(qp, q_stride, rows, heads, dim, kp, vp, kv_heads, slots, tp, width, cp, op, scale, window,
                              block_size, small, softcap, sinks);
#endif
  const int64_t group = heads / kv_heads, dim8 = dim / 8 * 8, rs = row_of<T>(dim);
  const float sc = (float)scale;
  parallel(rows * kv_heads, 1, small, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(group * dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / kv_heads, h = task % kv_heads;
      const int64_t len = std::min(cp[r], width * block_size);
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      scores.resize(group * n);
      const float* q0 = qp + r * q_stride + h * group * dim;
      const int64_t* table = tp + r * width;
      const T* kh = kp + h * slots * rs;
      const T* vh = vp + h * slots * rs;
      // fn(where the run starts in the head's storage, its first position counted from `first`, its length,
      // where the next block starts or -1) for each block's run of positions in [first, len)
      auto runs = [&](auto&& fn) {
        for (int64_t pos = first; pos < len;) {
          const int64_t b = pos / block_size, off = pos - b * block_size;
          const int64_t count = std::min(len - pos, block_size - off);
          const int64_t next = pos + count < len ? table[b + 1] * block_size * rs : -1;
          fn((table[b] * block_size + off) * rs, pos - first, count, next);
          pos += count;
        }
      };
      runs([&](int64_t at, int64_t i0, int64_t count, int64_t next) {
        const T* k = kh + at;
        float* s = scores.data() + i0;
        int64_t i = 0;
        for (; i + 4 <= count; i += 4) {
          if (next >= 0)  // the same positions of the next block
            for (int64_t b = i * rs; b < (i + 4) * rs; b += LINE<T>) __builtin_prefetch(kh + next + b);
          every_head_scores<4>(q0, group, k + i * rs, dim, dim8, sc, s + i, n);
        }
        for (; i < count; ++i) every_head_scores<1>(q0, group, k + i * rs, dim, dim8, sc, s + i, n);
      });
      std::vector<float> total(group, 0.f);
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * n;
        if (softcap > 0.f) soft_cap(sg, n, softcap);
        const float* sink = sinks ? sinks + h * group + g : nullptr;
        total[g] = exp_sum_sink(sg, n, *std::max_element(sg, sg + n), sink);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t g = 0; g < group; ++g) {
        const float* sg = scores.data() + g * n;
        float* ag = acc.data() + g * dim;
        runs([&](int64_t at, int64_t i0, int64_t count, int64_t next) {
          const T* v = vh + at;
          if (g == 0 && next >= 0)
            for (int64_t b = 0; b < count * rs; b += LINE<T>) __builtin_prefetch(vh + next + b);
          for (int64_t d = 0; d < dim8; d += 64)
            weighted_values_any(std::min<int64_t>(8, (dim8 - d) / 8), sg + i0, v + d, v, count, dim, ag + d);
          for (int64_t d = dim8; d < dim; ++d)
            for (int64_t i = 0; i < count; ++i)
              ag[d] = madd(sg[i0 + i] * row_scale(v + i * rs, dim), to_float(v[i * rs + d]), ag[d]);
        });
      }
      for (int64_t g = 0; g < group; ++g) {
        float* o = op + (r * heads + h * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] = acc[g * dim + d] / total[g];
      }
    }
  });
}

#include "x86/avx512_decode.h"


// Per query head, a sink's logit: where given, fp32 and one per head of `q`.
static const float* sinks_of(const c10::optional<torch::Tensor>& sinks, const torch::Tensor& q) {
  if (!sinks.has_value()) return nullptr;
  TORCH_CHECK(sinks->scalar_type() == torch::kFloat && sinks->is_contiguous() && sinks->numel() == q.size(1),
              "attention sinks: contiguous fp32, one per query head");
  return sinks->data_ptr<float>();
}

void paged_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor tables, torch::Tensor ctx,
                  torch::Tensor out, double scale, int64_t window, int64_t block_size, double softcap,
                  c10::optional<torch::Tensor> sinks) {
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && tables.is_contiguous() && ctx.is_contiguous(),
              "paged_decode: contiguous inputs, head-major cache");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && tables.scalar_type() == torch::kLong && ctx.scalar_type() == torch::kLong,
              "paged_decode: fp32 queries, int64 tables and lengths");
  const int64_t heads = q.size(1), dim = q.size(2);
  with_cache(k, v, [&](const auto* kp, const auto* vp) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(kp)>>;
    TORCH_CHECK(k.size(2) == row_of<T>(dim) && v.sizes() == k.sizes(), "paged_decode: cache rows of the queries' dim");
    decode_attention(q.data_ptr<float>(), heads * dim, q.size(0), heads, dim, kp, vp, k.size(0), k.size(1),
                     tables.data_ptr<int64_t>(), tables.size(1), ctx.data_ptr<int64_t>(), out.data_ptr<float>(), scale,
                     window, block_size, q.size(0) <= 2, (float)softcap, sinks_of(sinks, q));
  });
}
