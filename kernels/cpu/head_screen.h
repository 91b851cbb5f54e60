// Part of the kernels' one translation unit: cpu_kernels.cpp includes the parts in order, each using those
// before it. This one: the LM head's screen for greedy rows (`HeadScreen`).
#pragma once

// Greedy tokens through an fp32 (or bf16, fp16) LM head without computing every logit in fp32: the logits
// first through an int8 copy of the head over int8 rows (`a8_rows`, a quarter of the bytes, `vpdpbusd`'s
// products), each with a bound on its distance from the fp32 logit that `panel_rows` computes; then fp32 logits
// only for the features whose bounds reach the best lower bound, the same sums in the same order as
// `panel_rows` (lane-wise over the inputs in order: `panel_tile`), the largest at the smallest index winning as
// in `argmax_row`. The tokens are `argmax_row` of `panel_rows`'s logits, exactly: a feature outside the
// candidates has an fp32 logit below another's. The bound of feature j for row x, with s_j its weights'
// scale, q_j their int8 values, x~ the row rounded (blocks b of 32 inputs on scales t_b):
//   |x.W_j - x~.(s_j q_j)| <= s_j (|x|_1 + sum_b t_b |q_j in b|_1) / 2   (each rounding at most half a step),
// plus float rounding: the int8 path's fp32 sums of its blocks and the fp32 path's sum of K products, each
// at most (terms) x 2^-24 x the sum of their magnitudes (<= 127 s_j |x|_1). All of it is widened by 1% and by
// 2^-20 of the row's largest logit, which the float arithmetic of the bounds themselves stays well within.
// The sum over blocks is computed only for the features that a coarser bound keeps (the three blocks of the
// largest t_b at their own, the others at the next largest). Rows with a non-finite input, or with more than
// `SCREEN_MOST` candidates (a flat row, as from random weights), take every logit (`panel_rows`); where more
// than a quarter of a decoder's latest 128 rows did, its next greedy steps do without the screen, 16 of them,
// twice as many after each such window in a row, up to 512 (random weights: nearly every row; mixed-64: its
// first 128 rows, first tokens after random prompts, 32%, then 0-23%; resting 512 steps from there left the
// screen off for the whole run, 11.82-12.18 s against 11.10-11.47 with it on, alternating). SmolLM2 over mixed-64:
// ~220 features a row past the coarse bounds, ~46 past the finer ones, none taking every logit; its LM head
// 1.34 -> ~1.0 s of the run (the int8 pass 0.6-0.7 of it); one stream without speculation 56-59 -> 64-67 tok/s.
struct HeadScreen {
  Panels approx;  // the head's weights as `pack_panels_w8a8` packs them (no bias)
  const float* scale = nullptr;  // [V] s_j
  const float* spread = nullptr;  // [V] s_j |q_j|_1
  const float* blocks = nullptr;  // [K / 32, V] s_j |q_j in b|_1
  const float* feature_blocks = nullptr;  // [V, K / 32] the same, a feature's together
  float largest = 0.f;  // the largest s_j
  const float* rows = nullptr;  // [V, K] the head's fp32 weights, one feature a row (the model's own)
  const uint16_t* rows16 = nullptr;  // instead, its bf16 weights (a bf16 model's)
  const at::Half* rows_f16 = nullptr;  // or its fp16 weights
};

static constexpr int64_t SCREEN_MOST = 512;
// The greedy steps a decoder takes without the screen after a window of 128 rows of which more than a quarter
// took every logit: SCREEN_REST, doubled after each such window in a row, up to SCREEN_REST_MOST.
static constexpr int64_t SCREEN_REST = 16, SCREEN_REST_MOST = 512;

// The type of unquantized panels' weights (int8 ones: none of these, kChar).
static torch::ScalarType panels_dtype(const Panels& w) {
  return w.p ? torch::kFloat : w.h ? torch::kBFloat16 : w.f16 ? torch::kHalf : torch::kChar;
}

static inline bool finite_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return (bits & 0x7fffffffu) < 0x7f800000u;
}

// fp32 logits of row x for features idx[0 .. count) (count <= 16) from the head's weights row by row (`rows`
// [V, K], fp32, bf16 or fp16: T float, uint16_t or at::Half), into out: the same sums in the same order as
// `panel_rows` over its panels (lane by lane, the inputs in order, `madd(x, w, acc)` as `panel_tile16` computes it,
// 16-bit weights widened exactly), each feature's row read once (its panel would be 16 rows' worth of lines).
#ifdef __AVX512F__
template <typename T>
static inline void head_logits(const float* x, int64_t k, const T* rows, const int32_t* idx, int64_t count, float* out) {
  constexpr int64_t per = 4 / sizeof(T);  // inputs a gathered 32-bit word holds (K is even)
  alignas(64) int32_t at[16];
  for (int64_t i = 0; i < 16; ++i) at[i] = (int32_t)(idx[i < count ? i : 0] * k / per);  // (the rest repeat the first)
  for (int64_t i = 0; i < count; ++i)
    for (int64_t c = 0; c < k; c += LINE<T>) _mm_prefetch(reinterpret_cast<const char*>(rows + idx[i] * k + c), _MM_HINT_T0);
  const __m512i offsets = _mm512_load_si512(at);
  v16 acc{};
  for (int64_t c = 0; c < k; c += per) {
    const __m512i words = _mm512_i32gather_epi32(offsets, reinterpret_cast<const int32_t*>(rows) + c / per, 4);
    if constexpr (per == 1) {
      acc = madd(x[c], (v16)_mm512_castsi512_ps(words), acc);
    } else if constexpr (std::is_same_v<T, at::Half>) {  // (two fp16 inputs a word, the first in its low half)
      acc = madd(x[c], (v16)_mm512_cvtph_ps(_mm512_cvtepi32_epi16(words)), acc);
      acc = madd(x[c + 1], (v16)_mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(words, 16))), acc);
    } else {  // (two bf16 inputs a word, the first in its low half)
      acc = madd(x[c], (v16)_mm512_castsi512_ps(_mm512_slli_epi32(words, 16)), acc);
      acc = madd(x[c + 1], (v16)_mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32((int32_t)0xffff0000u))), acc);
    }
  }
  for (int64_t i = 0; i < count; ++i) out[i] = acc[i];
}
#endif

// fp32 logit j of row x through the head's panels, by `panel_tile` (the same sums as `panel_rows`).
[[maybe_unused]] static float panel_logit(const float* x, const Panels& head, int64_t j) {
  float t[PANEL];
  const int64_t at = (j / PANEL) * head.k * PANEL;
  if (head.h) panel_tile<1, uint16_t>(x, head.k, head.h + at, t, PANEL, PANEL, nullptr, nullptr);
  else if (head.f16) panel_tile<1, at::Half>(x, head.k, head.f16 + at, t, PANEL, PANEL, nullptr, nullptr);
  else panel_tile<1, float>(x, head.k, head.p + at, t, PANEL, PANEL, nullptr, nullptr);
  return t[j % PANEL];
}

// A row's token by the screen (see `HeadScreen`), or -1 where the row must take every logit.
static int64_t screened_row(const float* x, const uint8_t* q, const float* t, const float* a, const Panels& head,
                            const HeadScreen& sc, std::vector<float>& coarse, std::vector<int32_t>& first,
                            std::vector<float>& fine, std::vector<int32_t>& kept) {
  const int64_t k = head.k, n = head.n, nb = k / A8_BLOCK;
  float l1 = 0.f, l1q = 0.f;
  bool finite = true;
  for (int64_t c = 0; c < k; ++c) {
    finite &= finite_bits(x[c]);
    l1 += std::abs(x[c]);
  }
  for (int64_t b = 0; b < nb; ++b) {
    int32_t sum = 0;
    for (int64_t c = b * A8_BLOCK; c < (b + 1) * A8_BLOCK; ++c) sum += std::abs(int32_t(q[c]) - 128);
    l1q += t[b] * (float)sum;
    finite &= t[b] == 0.f || t[b] >= 1e-30f;  // (a subnormal scale's inverse overflows: not rounded to half a step)
  }
  // (a row whose logits could overflow: every logit; |x.W_j| <= |x|_1 127 s_j)
  if (!finite || !(l1 * 127.f * sc.largest < 1e37f)) return -1;
  const float u = 0x1p-24f, half = 1.01f * 0.5f;
  const float c1 = 1.01f * (0.5f * l1 + 1.02f * u * 127.f * ((float)(nb + 1) * l1q + (float)k * l1));
  // the coarse bounds: s_j c1 + (t_b s_j |q_j in b|_1 for the E blocks of the largest scales t_b, and the next
  // largest scale times the rest of s_j |q_j|_1) / 2, each into `coarse`; the best lower bound, the row's scale
  constexpr int64_t E = 3;
  int64_t order[E], taken = std::min<int64_t>(E, nb);
  float rest = 0.f, h[E];
  {
    std::vector<int64_t> all(nb);
    std::iota(all.begin(), all.end(), 0);
    std::partial_sort(all.begin(), all.begin() + taken, all.end(), [&](int64_t x, int64_t y) { return t[x] > t[y]; });
    for (int64_t e = 0; e < taken; ++e) order[e] = all[e], h[e] = half * t[all[e]];
    for (int64_t b = taken; b < nb; ++b) rest = std::max(rest, t[all[b]]);
  }
  const float hr = half * rest;
  const float* in[E];
  for (int64_t e = 0; e < taken; ++e) in[e] = sc.blocks + order[e] * n;
  coarse.resize(n);
  float* cb = coarse.data();
  float low = -INFINITY, big = 0.f;
  int64_t j0 = 0;
#ifdef __AVX512F__
  {
    const __m512 v1 = _mm512_set1_ps(c1), wr = _mm512_set1_ps(hr), sign = _mm512_set1_ps(-0.f), zero = _mm512_setzero_ps();
    __m512 lows = _mm512_set1_ps(-INFINITY), bigs = zero;
    for (; j0 + 16 <= n; j0 += 16) {
      __m512 bound = _mm512_mul_ps(_mm512_loadu_ps(sc.scale + j0), v1), those = zero;
      for (int64_t e = 0; e < taken; ++e) {
        const __m512 v = _mm512_loadu_ps(in[e] + j0);
        bound = _mm512_fmadd_ps(_mm512_set1_ps(h[e]), v, bound);
        those = _mm512_add_ps(those, v);
      }
      bound = _mm512_fmadd_ps(wr, _mm512_max_ps(zero, _mm512_sub_ps(_mm512_loadu_ps(sc.spread + j0), those)), bound);
      _mm512_storeu_ps(cb + j0, bound);
      const __m512 av = _mm512_loadu_ps(a + j0);
      lows = _mm512_max_ps(lows, _mm512_sub_ps(av, bound));
      bigs = _mm512_max_ps(bigs, _mm512_add_ps(_mm512_andnot_ps(sign, av), bound));
    }
    low = _mm512_reduce_max_ps(lows);
    big = _mm512_reduce_max_ps(bigs);
  }
#endif
  for (int64_t j = j0; j < n; ++j) {
    float bound = sc.scale[j] * c1, those = 0.f;
    for (int64_t e = 0; e < taken; ++e) bound += h[e] * in[e][j], those += in[e][j];
    cb[j] = bound += hr * std::max(0.f, sc.spread[j] - those);
    low = std::max(low, a[j] - bound);
    big = std::max(big, std::abs(a[j]) + bound);
  }
  const float slack = big * 0x1p-20f;
  low -= slack;
  first.clear();
  j0 = 0;
#ifdef __AVX512F__
  const __m512 lowv = _mm512_set1_ps(low);
  for (; j0 + 16 <= n; j0 += 16)
    for (uint32_t mask = _mm512_cmp_ps_mask(_mm512_add_ps(_mm512_loadu_ps(a + j0), _mm512_loadu_ps(cb + j0)), lowv, _CMP_GE_OQ);
         mask; mask &= mask - 1)
      first.push_back((int32_t)(j0 + __builtin_ctz(mask)));
#endif
  for (int64_t j = j0; j < n; ++j)
    if (a[j] + cb[j] >= low) first.push_back((int32_t)j);
  if ((int64_t)first.size() > 8 * SCREEN_MOST) return -1;  // (a flat row: the finer bounds would not pay)
  // the finer bounds of those: each block at its own scale
  float fine_low = -INFINITY;
  fine.resize(first.size());
  for (size_t i = 0; i < first.size(); ++i) {
    float sum = 0.f;
    const float* sb = sc.feature_blocks + first[i] * nb;
    for (int64_t b = 0; b < nb; ++b) sum += t[b] * sb[b];
    fine[i] = sc.scale[first[i]] * c1 + half * sum;
    fine_low = std::max(fine_low, a[first[i]] - fine[i]);
  }
  fine_low -= slack;
  kept.clear();
  for (size_t i = 0; i < first.size(); ++i)
    if (a[first[i]] + fine[i] >= fine_low) kept.push_back(first[i]);
  if (kept.empty() || (int64_t)kept.size() > SCREEN_MOST) return -1;
  int64_t best = -1;
  float top = 0.f, logits[16];
  for (size_t i = 0; i < kept.size(); i += 16) {
    const int64_t count = std::min<int64_t>(16, kept.size() - i);
#ifdef __AVX512F__
    if (sc.rows16) head_logits(x, k, sc.rows16, kept.data() + i, count, logits);
    else if (sc.rows_f16) head_logits(x, k, sc.rows_f16, kept.data() + i, count, logits);
    else head_logits(x, k, sc.rows, kept.data() + i, count, logits);
#else  // (each through its panel, as `panel_rows` computes it: without 512-bit vectors the engine has no screen)
    for (int64_t l = 0; l < count; ++l) logits[l] = panel_logit(x, head, kept[i + l]);
#endif
    for (int64_t l = 0; l < count; ++l)
      if (best < 0 || logits[l] > top) top = logits[l], best = kept[i + l];  // (ascending: the smallest index keeps a tie)
  }
  return best;
}

// The greedy token of each row of x [M, K] through `head` (fp32, bf16 or fp16 panels, no bias): `argmax_row` of
// `panel_rows`'s logits, by the screen (`HeadScreen`).
static std::vector<int64_t> screened_argmax(const float* x, int64_t m, const Panels& head, const HeadScreen& sc, bool small,
                                            int64_t* missed = nullptr) {
  const int64_t k = head.k, n = head.n, nb = k / A8_BLOCK;
  std::vector<uint8_t> q(m * k);
  std::vector<float> t(m * nb);
  // the int8 logits: kept from call to call on the thread (a fresh 6.7 MB for 34 rows of SmolLM2's, zeroed, was
  // ~0.7 ms of the head's 3)
  thread_local std::unique_ptr<float[]> held;
  thread_local int64_t capacity = 0;
  if (capacity < m * n) held.reset(new float[capacity = m * n]);
  float* a = held.get();
  quantize_rows(x, m, k, q.data(), t.data(), small);
  a8_rows_rounded(q.data(), t.data(), m, sc.approx, a, small);
  std::vector<int64_t> out(m, -1);
  parallel(m, 1, small, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> first, kept;
    std::vector<float> coarse, fine;
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * k;
      const uint8_t* qr = q.data() + r * k;
      const float* tr = t.data() + r * nb;
      const float* ar = a + r * n;
      out[r] = screened_row(xr, qr, tr, ar, head, sc, coarse, first, fine, kept);
    }
  });
  std::vector<int64_t> rest;  // rows that take every logit
  for (int64_t r = 0; r < m; ++r)
    if (out[r] < 0) rest.push_back(r);
  if (missed) *missed = rest.size();
  if (!rest.empty()) {
    const int64_t count = rest.size();
    std::vector<float> rows(count * k), logits(count * n);
    for (int64_t i = 0; i < count; ++i) std::copy(x + rest[i] * k, x + (rest[i] + 1) * k, rows.data() + i * k);
    panel_rows(rows.data(), count, head, logits.data(), count <= 2);
    for (int64_t i = 0; i < count; ++i) out[rest[i]] = argmax_row(logits.data() + i * n, n);
  }
  return out;
}

// The screen (`HeadScreen`) of a head of n features over k inputs: `weight` [n, k] its weights as its panels hold
// them (fp32, bf16 or fp16), `packed`
// them as `pack_panels_w8a8` packs them, `scales` [n] their scales, `spread` [n] each scale times the feature's
// sum of int8 magnitudes, `blocks` [k / 32, n] the same per block of 32 inputs and `feature_blocks` [n, k / 32]
// them transposed (`cpu_linear.head_screen` computes them).
static HeadScreen head_screen(int64_t n, int64_t k, const torch::Tensor& weight, const torch::Tensor& packed,
                              const torch::Tensor& scales, const torch::Tensor& spread, const torch::Tensor& blocks,
                              const torch::Tensor& feature_blocks) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == n && weight.size(1) == k && n * k < (int64_t(1) << 31),
              "head screen: the head's [V, K] weights (fewer than 2^31)");
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(weight.is_contiguous() && (dtype == torch::kFloat || dtype == torch::kBFloat16 || dtype == torch::kHalf) &&
              reinterpret_cast<uintptr_t>(weight.data_ptr()) % 4 == 0 && k % 2 == 0,
              "head screen: the head's weights contiguous, fp32, bf16 or fp16");
  for (const auto* t : {&scales, &spread, &blocks, &feature_blocks})
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == torch::kFloat, "head screen: contiguous fp32 bounds");
  TORCH_CHECK(k % A8_BLOCK == 0 && scales.numel() == n && spread.numel() == n && blocks.numel() == n * (k / A8_BLOCK) &&
              feature_blocks.numel() == blocks.numel(), "head screen: bounds of every feature");
  HeadScreen sc;
  sc.approx = panels_of(packed, n, torch::Tensor());
  TORCH_CHECK(sc.approx.a8 && sc.approx.k == k, "head screen: the head's weights from pack_panels_w8a8");
  sc.scale = scales.data_ptr<float>();
  sc.spread = spread.data_ptr<float>();
  sc.blocks = blocks.data_ptr<float>();
  sc.feature_blocks = feature_blocks.data_ptr<float>();
  sc.largest = scales.max().item<float>();
  if (dtype == torch::kBFloat16) sc.rows16 = data_of<uint16_t>(weight);
  else if (dtype == torch::kHalf) sc.rows_f16 = weight.data_ptr<at::Half>();
  else sc.rows = weight.data_ptr<float>();
  return sc;
}

// `argmax_rows(panel_linear(x, head, n, None))` for x [M, K] through `head` (`pack_panels`), computed by the
// screen (`head_screen`'s arguments): what the tests hold it to.
std::vector<int64_t> screened_argmax_rows(torch::Tensor x, torch::Tensor head, int64_t n, torch::Tensor weight,
                                          torch::Tensor packed, torch::Tensor scales, torch::Tensor spread,
                                          torch::Tensor blocks, torch::Tensor feature_blocks) {
  const Panels w = panels_of(head, n, torch::Tensor());
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == torch::kFloat && x.dim() == 2 && x.size(1) == w.k &&
              weight.scalar_type() == panels_dtype(w),
              "screened_argmax_rows: contiguous fp32 [M, K], fp32, bf16 or fp16 panels and weights alike");
  return screened_argmax(x.data_ptr<float>(), x.size(0), w,
                         head_screen(n, w.k, weight, packed, scales, spread, blocks, feature_blocks), x.size(0) <= 2);
}
