// Part of the kernels' one translation unit: cpu_kernels.cpp includes the parts in order, each using those
// before it. This one: decode attention on 512-bit vectors (`decode_attention16`).
#pragma once

#ifdef __AVX512F__
// The lanes of two vectors of partial sums folded in half: a holds the partial sums of keys 0 .. K-1 (P = 16 / K
// lanes each, key after key), b those of keys K .. 2K-1; the result holds all 2K keys' sums in P / 2 lanes each.
template <int P, int HALF>
constexpr std::array<int32_t, 16> fold_index() {
  std::array<int32_t, 16> idx{};
  for (int l = 0; l < 16; ++l) {
    const int key = l / (P / 2), keys = 16 / P;
    idx[l] = (key < keys ? 0 : 16) + key % keys * P + HALF * (P / 2) + l % (P / 2);
  }
  return idx;
}

// Into L2 only: prefetches into L1 kept the few buffers that L1 misses wait in full. On an AMD EPYC, decode
// attention read the cache at 15 GB/s where into L2 it reads 23-25 (SmolLM2's shapes, 64 rows at 300 positions,
// 30 layers' caches), and linears of 4-16 rows ran 5-12% faster.
static inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

// 16 fp32 values of the cache (fp32, or bf16 widened exactly).
static inline __m512 load512(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load512(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 load512(const int8_t* p) {  // codes of an int8 row (its scale not applied)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Sixteen rows of 16 floats transposed in registers: r[i] lane j becomes r[j] lane i (pairs of lanes interleaved,
// then pairs of pairs, then 128-bit quarters gathered from four vectors).
static inline void transpose16(__m512* r) {
  __m512 t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4)  // u[i + k]: rows i .. i + 3 of columns k, k + 4, k + 8, k + 12 (one per quarter)
    for (int k = 0; k < 2; ++k) {
      const __m512d a = _mm512_castps_pd(t[i + k]), b = _mm512_castps_pd(t[i + k + 2]);
      u[i + 2 * k] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      u[i + 2 * k + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    }
  for (int k = 0; k < 4; ++k) {  // column 4 l + k: quarter l of u[k], u[4 + k], u[8 + k], u[12 + k]
    const __m512 a0 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x44), a1 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xee);
    const __m512 a2 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x44), a3 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xee);
    r[k] = _mm512_shuffle_f32x4(a0, a2, 0x88);
    r[4 + k] = _mm512_shuffle_f32x4(a0, a2, 0xdd);
    r[8 + k] = _mm512_shuffle_f32x4(a1, a3, 0x88);
    r[12 + k] = _mm512_shuffle_f32x4(a1, a3, 0xdd);
  }
}

// A cache row's lines into L2 (an int8 row's scale may lie in the line after its codes').
template <typename T>
static inline void prefetch_row(const T* row, int64_t dim) {
  for (int64_t l = 0; l < dim; l += LINE<T>) prefetch_l2(row + l);
  if constexpr (QUANTIZED<T>) prefetch_l2(row + dim + 3);
}

template <int P>
static inline __m512 fold(__m512 a, __m512 b) {
  static constexpr std::array<int32_t, 16> lo = fold_index<P, 0>(), hi = fold_index<P, 1>();
  return _mm512_add_ps(_mm512_permutex2var_ps(a, _mm512_loadu_si512(lo.data()), b),
                       _mm512_permutex2var_ps(a, _mm512_loadu_si512(hi.data()), b));
}

// The dot products of HEADS query heads (one after another, `dim` a multiple of 16) with four keys, folded to four
// lanes a key: out[g] holds head g's sums with keys 0..3, four partial lanes each.
template <int HEADS, typename T>
static inline void quad_scores(const float* q, int64_t dim, const T* const* k, __m512* out) {
  __m512 acc[HEADS][4];
  for (int g = 0; g < HEADS; ++g)
    for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; d += 16) {
    __m512 kv[4];
    for (int j = 0; j < 4; ++j) kv[j] = load512(k[j] + d);
    for (int g = 0; g < HEADS; ++g) {
      const __m512 qv = _mm512_loadu_ps(q + g * dim + d);
      for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_fmadd_ps(qv, kv[j], acc[g][j]);
    }
  }
  for (int g = 0; g < HEADS; ++g) out[g] = fold<8>(fold<16>(acc[g][0], acc[g][1]), fold<16>(acc[g][2], acc[g][3]));
}

// Scores (times `scale`) of HEADS query heads against keys k[0 .. n16) (n16 a multiple of 16), into s[g * ld + i];
// the rows of keys `ahead` positions on are prefetched.
template <int HEADS, typename T>
static inline void group_scores(const float* q, int64_t dim, const T* const* k, int64_t n16, float scale, float* s,
                                int64_t ld, int64_t ahead) {
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < n16; i += 16) {
    // quads 0 and 1 folded before quads 2 and 3 are computed: fewer registers live, fewer spilled (64 rows at
    // ~240 positions, SmolLM2's 30 layers' caches, the same process alternating: 30.5 -> 31.6 GB/s)
    __m512 a[HEADS], b[HEADS], first[HEADS];
    for (int quad = 0; quad < 4; ++quad) {
      for (int64_t j = i + 4 * quad + ahead; j < std::min(n16, i + 4 * quad + ahead + 4); ++j) prefetch_row(k[j], dim);
      quad_scores<HEADS>(q, dim, k + i + 4 * quad, quad % 2 ? b : a);
      if (quad == 1)
        for (int g = 0; g < HEADS; ++g) first[g] = fold<4>(a[g], b[g]);
    }
    __m512 factor = sc;
    if constexpr (QUANTIZED<T>) {  // each key's scale
      alignas(64) float ks[16];
      for (int j = 0; j < 16; ++j) ks[j] = row_scale(k[i + j], dim);
      factor = _mm512_mul_ps(sc, _mm512_load_ps(ks));
    }
    for (int g = 0; g < HEADS; ++g)
      _mm512_storeu_ps(s + g * ld + i, _mm512_mul_ps(factor, fold<2>(first[g], fold<4>(a[g], b[g]))));
  }
}

// out[g * dim + d0 .. + 16 NV) = sum over keys i < n of w[g * ld + i] * v[i][d0 .. + 16 NV), for HEADS heads: each
// value row read once for all of them; the rows `ahead` keys on are prefetched.
template <int HEADS, int NV, typename T>
static inline void group_values(const float* w, int64_t ld, const T* const* v, int64_t n, int64_t d0, int64_t dim,
                                float* out, int64_t ahead) {
  __m512 acc[HEADS][NV];
  for (int g = 0; g < HEADS; ++g)
    for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    if (i + ahead < n) {
      for (int c = 0; c < NV; ++c) prefetch_l2(v[i + ahead] + d0 + 16 * c);
      if constexpr (QUANTIZED<T>) prefetch_l2(v[i + ahead] + dim + 3);
    }
    __m512 vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = load512(v[i] + d0 + 16 * c);
    const float vs = row_scale(v[i], dim);
    for (int g = 0; g < HEADS; ++g) {
      const __m512 p = _mm512_set1_ps(w[g * ld + i] * vs);
      for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < HEADS; ++g)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(out + g * dim + d0 + 16 * c, acc[g][c]);
}

template <int HEADS, typename T>
static inline void group_values_any(int64_t nv, const float* w, int64_t ld, const T* const* v, int64_t n, int64_t d0,
                                    int64_t dim, float* out, int64_t ahead) {
  switch (nv) {
    case 4: group_values<HEADS, 4>(w, ld, v, n, d0, dim, out, ahead); break;
    case 3: group_values<HEADS, 3>(w, ld, v, n, d0, dim, out, ahead); break;
    case 2: group_values<HEADS, 2>(w, ld, v, n, d0, dim, out, ahead); break;
    default: group_values<HEADS, 1>(w, ld, v, n, d0, dim, out, ahead); break;
  }
}

// `decode_attention` where the CPU has 512-bit vectors and `dim` is a multiple of 16. Each task first lists its
// context's key and value rows (through the block table; the key list padded to a multiple of 16 with a row of
// zeros), then takes 16 keys at a time against up to four query heads at a time, each key loaded once for all of
// them and each head's 16 sums folded together into one vector (where sums one by one spent most of their time
// adding a vector's lanes); values likewise, each row once for all heads. Rows of keys and values some way ahead
// are prefetched (the blocks lie anywhere in the cache, which the hardware prefetcher does not follow). Threads
// take the tasks one by one: a batch's contexts differ in length.
template <typename T>
static void decode_attention16(const float* qp, int64_t q_stride, int64_t rows, int64_t heads, int64_t dim,
                               const T* kp, const T* vp, int64_t kv_heads, int64_t slots, const int64_t* tp,
                               int64_t width, const int64_t* cp, float* op, double scale, int64_t window,
                               int64_t block_size, bool small, float softcap, const float* sinks) {
  // keys (value rows) prefetched ahead, two blocks at `block_size` 16: 64 rows at 300 positions, best of 20, three
  // alternating processes, 16 / 32 / 64 ahead: 1175-1392 / 1099-1130 / 1135-1241 us a layer
  constexpr int64_t AHEAD = 32;
  const int64_t group = heads / kv_heads, rs = row_of<T>(dim);
  const float sc = (float)scale;
  // Rows of one request's consecutive positions over the same block table (a checking pass's token and its
  // guesses, `FusedDecoder.check` / `speculate`) go to one task a head, one row after the other: the rows after
  // the first read that head's keys and values from the core's L2 instead of memory. Each row is computed as
  // it would be alone.
  std::vector<int64_t> starts{0};
  for (int64_t r = 1; r < rows; ++r)
    if (cp[r] != cp[r - 1] + 1 || std::memcmp(tp + r * width, tp + (r - 1) * width, width * sizeof(int64_t)) != 0)
      starts.push_back(r);
  starts.push_back(rows);
  const int64_t runs = (int64_t)starts.size() - 1, tasks = runs * kv_heads;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks));
  std::atomic<int64_t> next{0};
  parallel(threads, 1, small, [&](int64_t, int64_t) {
    std::vector<float> scores, acc(group * dim), total(group);
    std::vector<T> zeros(rs, T{});  // (+0.0 in fp32 and in bf16; int8 codes 0 at scale 0)
    std::vector<const T*> krows, vrows;
    for (int64_t task; (task = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      const int64_t h = task % kv_heads;
      for (int64_t r = starts[task / kv_heads]; r < starts[task / kv_heads + 1]; ++r) {
        const int64_t len = std::min(cp[r], width * block_size);
        const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
        const int64_t n = len - first, n16 = (n + 15) / 16 * 16;
        scores.resize(group * n16);
        krows.resize(n16);
        vrows.resize(n);
        const int64_t* table = tp + r * width;
        const T* kh = kp + h * slots * rs;
        const T* vh = vp + h * slots * rs;
        for (int64_t pos = first, i = 0; pos < len;) {  // block by block (no division a key)
          const int64_t b = pos / block_size, off = pos - b * block_size, count = std::min(len - pos, block_size - off);
          const int64_t at = (table[b] * block_size + off) * rs;
          for (int64_t c = 0; c < count; ++c, ++i) {
            krows[i] = kh + at + c * rs;
            vrows[i] = vh + at + c * rs;
          }
          pos += count;
        }
        for (int64_t i = n; i < n16; ++i) krows[i] = zeros.data();
        const float* q0 = qp + r * q_stride + h * group * dim;
        for (int64_t g = 0; g < group;) {
          const int64_t take = std::min<int64_t>(4, group - g);
          float* s = scores.data() + g * n16;
          if (take == 4) group_scores<4>(q0 + g * dim, dim, krows.data(), n16, sc, s, n16, AHEAD);
          else if (take == 3) group_scores<3>(q0 + g * dim, dim, krows.data(), n16, sc, s, n16, AHEAD);
          else if (take == 2) group_scores<2>(q0 + g * dim, dim, krows.data(), n16, sc, s, n16, AHEAD);
          else group_scores<1>(q0 + g * dim, dim, krows.data(), n16, sc, s, n16, AHEAD);
          g += take;
        }
        for (int64_t i = 0; i < std::min<int64_t>(n, AHEAD); ++i) prefetch_row(vrows[i], dim);  // while the weights compute
        for (int64_t g = 0; g < group; ++g) {
          float* sg = scores.data() + g * n16;
          if (softcap > 0.f) soft_cap(sg, n, softcap);
          __m512 top = _mm512_set1_ps(-INFINITY);
          for (int64_t i = 0; i < n; i += 16)
            top = _mm512_max_ps(top, _mm512_mask_loadu_ps(top, n - i >= 16 ? 0xffff : (1u << (n - i)) - 1, sg + i));
          total[g] = exp_sum_sink(sg, n, _mm512_reduce_max_ps(top), sinks ? sinks + h * group + g : nullptr);
        }
        for (int64_t g = 0; g < group;) {  // three heads x 64 dims of sums at a time (12 vectors)
          const int64_t take = std::min<int64_t>(3, group - g);
          for (int64_t d0 = 0; d0 < dim; d0 += 64) {
            const int64_t nv = std::min<int64_t>(4, (dim - d0) / 16);
            const float* w = scores.data() + g * n16;
            float* out = acc.data() + g * dim;
            if (take == 3) group_values_any<3>(nv, w, n16, vrows.data(), n, d0, dim, out, AHEAD);
            else if (take == 2) group_values_any<2>(nv, w, n16, vrows.data(), n, d0, dim, out, AHEAD);
            else group_values_any<1>(nv, w, n16, vrows.data(), n, d0, dim, out, AHEAD);
          }
          g += take;
        }
        for (int64_t g = 0; g < group; ++g) {
          float* o = op + (r * heads + h * group + g) * dim;
          const float inv = 1.f / total[g];
          for (int64_t d = 0; d < dim; ++d) o[d] = acc[g * dim + d] * inv;
        }
      }
    }
  });
}
#endif
