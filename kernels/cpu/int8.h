// Part of the kernels' one translation unit: cpu_kernels.cpp includes the parts in order, each using those
// before it. This one: int8 weights (`pack_panels_int8`) and int8 activations (w8a8, `pack_panels_w8a8`).
#pragma once


typedef int8_t c8 __attribute__((vector_size(8)));
typedef int32_t i8 __attribute__((vector_size(32)));

// Eight int8 weights widened to fp32 (GCC 12 turns the generic conversion into scalar code: 2.8 GB/s against
// the vector instructions' memory pace).
static inline v8 load_int8(const int8_t* p) {
#ifdef __AVX2__
  return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  c8 v;
  std::memcpy(&v, p, sizeof v);
  return __builtin_convertvector(__builtin_convertvector(v, i8), v8);
#endif
}

// ROWS rows x NP neighbouring int8 panels (`pack_panels_int8`): the weights widened to fp32 as they are loaded,
// the sums scaled once at the end.
template <int ROWS, int NP>
static inline void qpanel_tile(const float* xp, int64_t k, const int8_t* panel, float* yp, int64_t ldy, int64_t n_left,
                               const float* bias) {
  const int64_t width = k * PANEL + PANEL * 4;
  v8 acc[ROWS][NP][2];
  for (int r = 0; r < ROWS; ++r)
    for (int q = 0; q < NP; ++q) acc[r][q][0] = acc[r][q][1] = v8{};
  for (int64_t c = 0; c < k; ++c) {
    v8 w[NP][2];
    for (int q = 0; q < NP; ++q) {
      w[q][0] = load_int8(panel + q * width + c * PANEL);
      w[q][1] = load_int8(panel + q * width + c * PANEL + 8);
    }
    for (int r = 0; r < ROWS; ++r) {
      const float s = xp[r * k + c];
      for (int q = 0; q < NP; ++q) {
        acc[r][q][0] = madd(s, w[q][0], acc[r][q][0]);
        acc[r][q][1] = madd(s, w[q][1], acc[r][q][1]);
      }
    }
  }
  for (int q = 0; q < NP; ++q) {
    const float* scale = reinterpret_cast<const float*>(panel + q * width + k * PANEL);
    const v8 s0 = load8(scale), s1 = load8(scale + 8);
    const int64_t cols = std::min(PANEL, n_left - q * PANEL);
    for (int r = 0; r < ROWS; ++r) {
      acc[r][q][0] *= s0;
      acc[r][q][1] *= s1;
      store_panel(acc[r][q], yp + r * ldy + q * PANEL, cols, bias ? bias + q * PANEL : nullptr);
    }
  }
}

template <int NP>
static inline void qpanel_tile_rows(int64_t rows, const float* xp, int64_t k, const int8_t* panel, float* yp, int64_t ldy,
                                    int64_t n_left, const float* bias) {
  switch (rows) {
    case 4: qpanel_tile<4, NP>(xp, k, panel, yp, ldy, n_left, bias); break;
    case 3: qpanel_tile<3, NP>(xp, k, panel, yp, ldy, n_left, bias); break;
    case 2: qpanel_tile<2, NP>(xp, k, panel, yp, ldy, n_left, bias); break;
    default: qpanel_tile<1, NP>(xp, k, panel, yp, ldy, n_left, bias); break;
  }
}

#ifdef __AVX512F__
// ROWS rows (one to six) x NP int8 panels on 512-bit vectors: each panel's 16 weights a column widened once,
// ROWS * NP accumulator chains (enough to keep both FMA pipes busy at one row), the sums scaled at the end.
// Each output sums the same products in the same order as the many-row path below, so that a row's outputs do
// not depend on the rows computed with it.
template <int ROWS, int NP>
static inline void qpanel_few(const float* xp, int64_t k, const int8_t* panel, int64_t width, float* yp, int64_t ldy,
                              int64_t n_left, const float* bias) {
  v16 acc[ROWS][NP];
  for (int r = 0; r < ROWS; ++r)
    for (int q = 0; q < NP; ++q) acc[r][q] = v16{};
  for (int64_t c = 0; c < k; ++c) {
    v16 w[NP];
    for (int q = 0; q < NP; ++q)
      w[q] = (v16)_mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + q * width + c * PANEL))));
    for (int r = 0; r < ROWS; ++r) {
      const float s = xp[r * k + c];
      for (int q = 0; q < NP; ++q) acc[r][q] = madd(s, w[q], acc[r][q]);
    }
  }
  for (int q = 0; q < NP; ++q) {
    v16 scale;
    std::memcpy(&scale, panel + q * width + k * PANEL, sizeof scale);
    const int64_t cols = std::min(PANEL, n_left - q * PANEL);
    for (int r = 0; r < ROWS; ++r) {
      acc[r][q] *= scale;
      store_panel(reinterpret_cast<const v8*>(&acc[r][q]), yp + r * ldy + q * PANEL, cols, bias ? bias + q * PANEL : nullptr);
    }
  }
}

// `qpanel_few` over the panels [first, last) of `w`, NP at a time, for `rows` rows (1 to 6).
template <int ROWS>
static inline void qpanel_few_range(const float* xp, const Panels& w, int64_t first, int64_t last, float* yp) {
  constexpr int NP = ROWS <= 2 ? 8 : 4;  // (accumulators and weights within the 32 registers)
  const int64_t k = w.k, n = w.n, width = k * PANEL + PANEL * 4;
  int64_t p = first;
  for (; p + NP <= last; p += NP)
    qpanel_few<ROWS, NP>(xp, k, w.q + p * width, width, yp + p * PANEL, n, n - p * PANEL, w.bias ? w.bias + p * PANEL : nullptr);
  for (; p < last; ++p)
    qpanel_few<ROWS, 1>(xp, k, w.q + p * width, width, yp + p * PANEL, n, n - p * PANEL, w.bias ? w.bias + p * PANEL : nullptr);
}

// `qpanel_few_range` for 1 to R rows.
template <int R>
static inline void qpanel_few_rows(int64_t rows, const float* xp, const Panels& w, int64_t first, int64_t last, float* yp) {
  if constexpr (R > 1)
    if (rows < R) return qpanel_few_rows<R - 1>(rows, xp, w, first, last, yp);
  qpanel_few_range<R>(xp, w, first, last, yp);
}
#endif

// `panel_rows` over int8 panels. With 512-bit vectors, up to 48 rows go through `qpanel_few` tiles of up to six
// rows and more widen each pair of panels once (below); without, rows in tiles of up to four, panels in pairs
// (two streams for the prefetcher).
// (A single row through four panels at once read 17.6-22.2 against 15.9-17.5 GB/s alone over 134 MB, but the
// draft's whole pass took the same 9.6-9.7 ms.)
static void qpanel_rows(const float* xp, int64_t m, const Panels& w, float* yp, bool small) {
  constexpr int64_t FEW_ROWS = 48;  // (tiles of up to six rows; widened beyond: 16 rows 16.4 -> 12.6 ms, SmolLM2)
  constexpr int64_t TILE = 4;
  const int64_t k = w.k, n = w.n, width = k * PANEL + PANEL * 4;
  const int64_t panels = (n + PANEL - 1) / PANEL;
#ifdef __AVX512F__
  if (m <= FEW_ROWS) {
    constexpr int64_t GROUP = 8;  // panels a task (a multiple of the tiles' NP)
    parallel((panels + GROUP - 1) / GROUP, 1, small, [&](int64_t begin, int64_t end) {
      const int64_t first = begin * GROUP, last = std::min(panels, end * GROUP);
      for (int64_t r = 0; r < m; r += 6) qpanel_few_rows<6>(std::min<int64_t>(6, m - r), xp + r * k, w, first, last, yp + r * n);
    });
    return;
  }
  {
    // Each pair of panels widened to fp32 once (into this thread's buffer, in L2), then every row through the
    // fp32 `panel_tile16`s, the sums scaled at the end as below (the same products summed in the same order).
    // Widened again for every tile of four rows on 8-wide vectors, a draft pass of 15 rows took longer than
    // the fp32 model's own step (28.2 against 21.8 ms), and speculation did not pay beyond a few rows.
    constexpr int64_t TILE16 = 12;
    parallel((panels + 1) / 2, 1, small, [&](int64_t begin, int64_t end) {
      std::vector<float> wide(2 * k * PANEL);
      float tile[TILE16 * 2 * PANEL];
      for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t p = 2 * pair, j = p * PANEL, count = std::min<int64_t>(2, panels - p);
        for (int64_t q = 0; q < 2; ++q)
          for (int64_t i = 0; i < k * PANEL; i += 16)
            _mm512_storeu_ps(wide.data() + q * k * PANEL + i,
                            q < count ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                                            reinterpret_cast<const __m128i*>(w.q + (p + q) * width + i))))
                                      : _mm512_setzero_ps());
        // the next pair's int8 weights (half the bytes of an fp32 panel, which the tile's prefetch covers twice
        // over) brought into L2 while the first tile computes
        const float* next = pair + 1 < end ? reinterpret_cast<const float*>(w.q + (p + 2) * width) : nullptr;
        for (int64_t r = 0; r < m; r += TILE16) {
          const int64_t rows = std::min(TILE16, m - r);
          panel_tile16_rows<TILE16>(rows, xp + r * k, k, wide.data(), wide.data() + k * PANEL, tile, 2 * PANEL, PANEL,
                                    nullptr, r == 0 ? next : nullptr);
          for (int64_t q = 0; q < count; ++q) {
            const float* scale = reinterpret_cast<const float*>(w.q + (p + q) * width + k * PANEL);
            const v8 s0 = load8(scale), s1 = load8(scale + 8);
            const int64_t cols = std::min(PANEL, n - j - q * PANEL);
            for (int64_t i = 0; i < rows; ++i) {
              v8 acc[2] = {load8(tile + i * 2 * PANEL + q * PANEL) * s0, load8(tile + i * 2 * PANEL + q * PANEL + 8) * s1};
              store_panel(acc, yp + (r + i) * n + j + q * PANEL, cols, w.bias ? w.bias + j + q * PANEL : nullptr);
            }
          }
        }
      }
    });
    return;
  }
#endif
  parallel((panels + 1) / 2, 1, small, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t p = 2 * pair, j = p * PANEL;
      const int8_t* panel = w.q + p * width;
      const float* b = w.bias ? w.bias + j : nullptr;
      for (int64_t r = 0; r < m; r += TILE) {
        const int64_t rows = std::min(TILE, m - r);
        if (p + 1 < panels)
          qpanel_tile_rows<2>(rows, xp + r * k, k, panel, yp + r * n + j, n, n - j, b);
        else
          qpanel_tile_rows<1>(rows, xp + r * k, k, panel, yp + r * n + j, n, n - j, b);
      }
    }
  });
}

// int8 weights for int8 activations (`EngineConfig.weights="w8a8"`): the row blocks `qs` ([N_i, K] int8 each, K a
// multiple of 32) stacked, `scales` [N] fp32 each output feature's scale (`cpu_linear.int8_weights`). Each panel of
// 16 output features: its weights four inputs at a time ([K / 4][16][4] bytes: one 512-bit vector holds four
// inputs of all 16, what `vpdpbusd` multiplies), then for each block of 32 inputs -128 x the sum of each feature's
// weights in it ([K / 32][16] int32: activations go in as unsigned bytes, q + 128, and a block's sums start from
// this to take the 128 back out), then the 16 scales. [ceil(N / 16), K * 18 + 64] bytes.
static constexpr int64_t A8_BLOCK = 32;

static inline int64_t w8a8_width(int64_t k) { return k * PANEL + k / A8_BLOCK * PANEL * 4 + PANEL * 4; }

torch::Tensor pack_panels_w8a8(std::vector<torch::Tensor> qs, torch::Tensor scales) {
  const auto [n, k] = int8_stacked_shape(qs, scales);
  TORCH_CHECK(k % A8_BLOCK == 0, "pack_panels_w8a8: the input width must be a multiple of 32");
  const int64_t width = w8a8_width(k), blocks = k / A8_BLOCK;
  auto out = huge_page_tensor({(n + PANEL - 1) / PANEL, width}, torch::kByte);
  uint8_t* op = out.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  std::vector<torch::Tensor> held;
  const auto rows = stacked_rows<int8_t>(qs, held);
  parallel_pack(out.size(0), [&](int64_t begin, int64_t end) {  // (a panel a task)
    for (int64_t j = begin * PANEL; j < std::min(n, end * PANEL); ++j) {  // output feature
      uint8_t* panel = op + (j / PANEL) * width;
      const int64_t f = j % PANEL;
      int32_t* sums = reinterpret_cast<int32_t*>(panel + k * PANEL);
      const int8_t* qp = rows[j];
      for (int64_t c = 0; c < k; ++c) {
        panel[((c / 4) * PANEL + f) * 4 + c % 4] = static_cast<uint8_t>(qp[c]);
        sums[(c / A8_BLOCK) * PANEL + f] -= 128 * qp[c];
      }
      std::memcpy(panel + k * PANEL + blocks * PANEL * 4 + f * 4, sp + j, 4);
    }
  });
  return out;
}

// Rows [M, K] rounded to int8 in blocks of 32 inputs, each on its own scale (its largest magnitude / 127; a block
// of zeros: 0), stored as q + 128 (unsigned) in `q` [M, K]; the scales in `s` [M, K / 32]. Rounding to nearest,
// ties to even, as `cpu_linear.int8_activations` does.
static void quantize_rows(const float* x, int64_t m, int64_t k, uint8_t* q, float* s, bool small) {
  const int64_t blocks = k / A8_BLOCK;
#ifdef __AVX512F__
  parallel(m, 16, small, [&](int64_t begin, int64_t end) {
    const __m512 sign = _mm512_set1_ps(-0.f);
    const __m512i low = _mm512_set1_epi32(-127), high = _mm512_set1_epi32(127), offset = _mm512_set1_epi32(128);
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < blocks; ++b) {
        const float* xb = x + r * k + b * A8_BLOCK;
        const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
        const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, x0), _mm512_andnot_ps(sign, x1)));
        const float scale = top / 127.f, inverse = top > 0.f ? 1.f / scale : 0.f;
        s[r * blocks + b] = scale;
        const __m512 inv = _mm512_set1_ps(inverse);
        for (int h = 0; h < 2; ++h) {  // (the conversion rounds to nearest, ties to even)
          __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(h ? x1 : x0, inv));
          v = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(v, low), high), offset);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(q + r * k + b * A8_BLOCK + 16 * h), _mm512_cvtepi32_epi8(v));
        }
      }
  });
  return;
#endif
  for (int64_t r = 0; r < m; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + r * k + b * A8_BLOCK;
      float top = 0.f;
      for (int64_t i = 0; i < A8_BLOCK; ++i) top = std::max(top, std::abs(xb[i]));
      const float scale = top / 127.f, inverse = top > 0.f ? 1.f / scale : 0.f;
      s[r * blocks + b] = scale;
      for (int64_t i = 0; i < A8_BLOCK; ++i)
        q[r * k + b * A8_BLOCK + i] =
            static_cast<uint8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(xb[i] * inverse))) + 128.f);
    }
}

#ifdef __AVX512VNNI__
// ROWS rows x NP panels of w8a8 weights: per block of 32 inputs, the exact int32 dot products (`vpdpbusd`, from
// the block's -128 x sums), then times the row's block scale into fp32 sums, block after block; at the end
// times the features' scales, plus the bias. A row's outputs do not depend on the rows computed with it.
template <int ROWS, int NP>
static inline void a8_tile(const uint8_t* q, const float* s, int64_t k, const uint8_t* panel, int64_t width, float* yp,
                           int64_t ldy, int64_t n_left, const float* bias) {
  const int64_t blocks = k / A8_BLOCK;
  __m512 f[ROWS][NP];
  for (int r = 0; r < ROWS; ++r)
    for (int p = 0; p < NP; ++p) f[r][p] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i a[ROWS][NP];
    for (int p = 0; p < NP; ++p) {
      const __m512i start = _mm512_loadu_si512(panel + p * width + k * PANEL + b * PANEL * 4);
      for (int r = 0; r < ROWS; ++r) a[r][p] = start;
    }
    for (int64_t g = b * (A8_BLOCK / 4); g < (b + 1) * (A8_BLOCK / 4); ++g) {
      __m512i w[NP];
      for (int p = 0; p < NP; ++p) w[p] = _mm512_loadu_si512(panel + p * width + g * PANEL * 4);
      for (int r = 0; r < ROWS; ++r) {
        int32_t four;
        std::memcpy(&four, q + r * k + g * 4, 4);
        const __m512i x = _mm512_set1_epi32(four);
        for (int p = 0; p < NP; ++p) a[r][p] = _mm512_dpbusd_epi32(a[r][p], x, w[p]);
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m512 scale = _mm512_set1_ps(s[r * blocks + b]);
      for (int p = 0; p < NP; ++p) f[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r][p]), scale, f[r][p]);
    }
  }
  for (int p = 0; p < NP; ++p) {
    const __m512 scale = _mm512_loadu_ps(reinterpret_cast<const float*>(panel + p * width + k * PANEL + blocks * PANEL * 4));
    const int64_t cols = std::min(PANEL, n_left - p * PANEL);
    for (int r = 0; r < ROWS; ++r) {
      const __m512 out = _mm512_mul_ps(f[r][p], scale);
      store_panel(reinterpret_cast<const v8*>(&out), yp + r * ldy + p * PANEL, cols, bias ? bias + p * PANEL : nullptr);
    }
  }
}

// `a8_tile` for 1 to R rows.
template <int R, int NP>
static inline void a8_tile_rows(int64_t rows, const uint8_t* q, const float* s, int64_t k, const uint8_t* panel,
                                int64_t width, float* yp, int64_t ldy, int64_t n_left, const float* bias) {
  if constexpr (R > 1)
    if (rows < R) return a8_tile_rows<R - 1, NP>(rows, q, s, k, panel, width, yp, ldy, n_left, bias);
  a8_tile<R, NP>(q, s, k, panel, width, yp, ldy, n_left, bias);
}
#endif

// y = x @ w.T (+ b) over `pack_panels_w8a8` weights, x's rows rounded to int8 first (`quantize_rows`). Threads
// split the panels in groups of four; rows go through in tiles of up to three. Without AVX-512 VNNI, the same
// sums in scalar code (correct, slow).
static void a8_rows_rounded(const uint8_t* q, const float* s, int64_t m, const Panels& w, float* yp, bool small);

static void a8_rows(const float* xp, int64_t m, const Panels& w, float* yp, bool small) {
  std::vector<uint8_t> q(m * w.k);
  std::vector<float> s(m * (w.k / A8_BLOCK));
  quantize_rows(xp, m, w.k, q.data(), s.data(), small);
  a8_rows_rounded(q.data(), s.data(), m, w, yp, small);
}

// `a8_rows` over rows already rounded (`quantize_rows`: q, s).
static void a8_rows_rounded(const uint8_t* q, const float* s, int64_t m, const Panels& w, float* yp, bool small) {
  const int64_t k = w.k, n = w.n, width = w8a8_width(k), blocks = k / A8_BLOCK;
  const int64_t panels = (n + PANEL - 1) / PANEL;
#ifdef __AVX512VNNI__
  constexpr int TILE = 3, NP = 4;  // (rows x panels a tile; at 256 rows of SmolLM2 3 x 4 75 ms, 6 x 2 79, 8 x 1 84)
  parallel((panels + NP - 1) / NP, 1, small, [&](int64_t begin, int64_t end) {
    for (int64_t group = begin; group < end; ++group) {
      const int64_t p = NP * group, j = p * PANEL;
      const uint8_t* panel = w.a8 + p * width;
      const float* b = w.bias ? w.bias + j : nullptr;
      for (int64_t r = 0; r < m; r += TILE) {
        const int64_t rows = std::min<int64_t>(TILE, m - r);
        if (p + NP <= panels) {
          a8_tile_rows<TILE, NP>(rows, q + r * k, s + r * blocks, k, panel, width, yp + r * n + j, n, n - j, b);
        } else {
          for (int64_t i = p; i < panels; ++i)
            a8_tile_rows<TILE, 1>(rows, q + r * k, s + r * blocks, k, w.a8 + i * width, width,
                                  yp + r * n + i * PANEL, n, n - i * PANEL, w.bias ? w.bias + i * PANEL : nullptr);
        }
      }
    }
  });
#else
  parallel(panels, 1, small, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* panel = w.a8 + p * width;
      const int32_t* sums = reinterpret_cast<const int32_t*>(panel + k * PANEL);
      const float* scale = reinterpret_cast<const float*>(panel + k * PANEL + blocks * PANEL * 4);
      for (int64_t r = 0; r < m; ++r)
        for (int64_t f = 0; f < PANEL && p * PANEL + f < n; ++f) {
          float total = 0.f;
          for (int64_t b = 0; b < blocks; ++b) {
            int32_t dot = sums[b * PANEL + f];
            for (int64_t c = b * A8_BLOCK; c < (b + 1) * A8_BLOCK; ++c)
              dot += int32_t(q[r * k + c]) * int32_t(int8_t(panel[((c / 4) * PANEL + f) * 4 + c % 4]));
            total = madd(float(dot), s[r * blocks + b], total);
          }
          const int64_t j = p * PANEL + f;
          yp[r * n + j] = total * scale[f] + (w.bias ? w.bias[j] : 0.f);
        }
    }
  });
#endif
}

// Each output feature of `w` ([N, K], fp32, bf16 or fp16) rounded to int8 on its own scale, its largest magnitude /
// 127 (1 for an all-zero one), to nearest even in fp32: the int8 weights and their scales as `int8_weights` in
// `kernels/cpu_linear.py` defines them, one pass a feature and threads over the features (torch's eight passes over
// widened copies took 22 s of a 3B model's start-up for its draft).
template <typename T>
static void int8_rows_as(const T* wp, int64_t n, int64_t k, int8_t* qp, float* sp) {
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* row = wp + i * k;
      float top = 0.f;
      for (int64_t c = 0; c < k; ++c) top = std::max(top, std::fabs(static_cast<float>(row[c])));
      const float scale = top > 0.f ? top / 127.f : 1.f;
      for (int64_t c = 0; c < k; ++c)
        qp[i * k + c] = static_cast<int8_t>(std::clamp(std::nearbyint(static_cast<float>(row[c]) / scale), -127.f, 127.f));
      sp[i] = scale;
    }
  });
}

std::tuple<torch::Tensor, torch::Tensor> int8_rows(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.device().is_cpu(), "int8_rows: weights [N, K] on the CPU");
  const auto weights = w.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  auto q = torch::empty({n, k}, torch::kChar);
  auto scales = torch::empty({n}, torch::kFloat);
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scales.data_ptr<float>();
  if (w.scalar_type() == torch::kBFloat16) int8_rows_as(weights.data_ptr<at::BFloat16>(), n, k, qp, sp);
  else if (w.scalar_type() == torch::kHalf) int8_rows_as(weights.data_ptr<at::Half>(), n, k, qp, sp);
  else {
    TORCH_CHECK(w.scalar_type() == torch::kFloat, "int8_rows: fp32, bf16 or fp16 weights");
    int8_rows_as(weights.data_ptr<float>(), n, k, qp, sp);
  }
  return {q, scales};
}

// The int8 copy of a packed bf16 linear (`pack_panels` or `pack_panels_gated` panels, or `vnni_panels`' pairs, of `n`
// output features) as `pack_panels_int8` packs `int8_rows`' rounding of its weights, in one pass over the panels
// without unpacking them (a gated MLP's gate features first, then up's, as the speculative draft stacks them).
torch::Tensor int8_from_panels(torch::Tensor packed, int64_t n, bool gated) {
  TORCH_CHECK(packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous() && (packed.dim() == 3 || packed.dim() == 4),
              "int8_from_panels: bf16 panels from pack_panels, pack_panels_gated or vnni_panels");
  const bool vnni = packed.dim() == 4;
  const int64_t panels = packed.size(0), k = vnni ? packed.size(1) * 2 : packed.size(1);
  TORCH_CHECK(panels == (n + PANEL - 1) / PANEL && (!gated || n % (2 * PANEL) == 0),
              "int8_from_panels: ", n, " output features do not fill ", panels, " panels");
  const int64_t width = k * PANEL + PANEL * 4;
  auto out = huge_page_tensor({panels, width}, torch::kChar);
  const at::BFloat16* ip = packed.data_ptr<at::BFloat16>();
  int8_t* op = out.data_ptr<int8_t>();
  parallel_pack(panels, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t to = gated ? (p % 2 ? panels / 2 + p / 2 : p / 2) : p;  // (gated: gate, up, gate, up, ...)
      const at::BFloat16* panel = ip + p * k * PANEL;
      int8_t* qp = op + to * width;
      // Input by input over the panel's 16 features side by side, reading and writing the panels in order: a
      // padded feature's weights are zeros, rounded to zeros; its scale is left as the zeroed page has it.
      auto weight = [&](int64_t c, int64_t j) {
        return static_cast<float>(panel[vnni ? (c / 2) * 2 * PANEL + 2 * j + c % 2 : c * PANEL + j]);
      };
      float top[PANEL] = {}, scale[PANEL];
      for (int64_t c = 0; c < k; ++c)
        for (int64_t j = 0; j < PANEL; ++j) top[j] = std::max(top[j], std::fabs(weight(c, j)));
      for (int64_t j = 0; j < PANEL; ++j) scale[j] = top[j] > 0.f ? top[j] / 127.f : 1.f;
      for (int64_t c = 0; c < k; ++c)
        for (int64_t j = 0; j < PANEL; ++j)
          qp[c * PANEL + j] = static_cast<int8_t>(std::clamp(std::nearbyint(weight(c, j) / scale[j]), -127.f, 127.f));
      const int64_t features = std::min<int64_t>(PANEL, n - to * PANEL);
      std::memcpy(qp + k * PANEL, scale, 4 * features);
    }
  });
  return out;
}
