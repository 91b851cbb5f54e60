// Part of the kernels' one translation unit: cpu_kernels.cpp includes the parts in order, each using those
// before it. This one: the linear panels' tiles on 512-bit vectors (fp32, bf16 and fp16 weights).
#pragma once

#ifdef __AVX512F__
typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t h16 __attribute__((vector_size(32)));
typedef uint32_t u16v __attribute__((vector_size(64)));

static inline v16 load16(const float* p) { return load_floats<v16>(p); }
static inline v16 madd(v16 a, v16 b, v16 c) { return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
static inline v16 madd(float a, v16 b, v16 c) { return madd((v16)_mm512_set1_ps(a), b, c); }
static inline v16 load16(const uint16_t* p) { return load_bf16<v16, h16, u16v>(p); }

static inline v16 load16(const at::Half* p) {  // fp16, widened
  return (v16)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Where the CPU has 512-bit vectors: ROWS rows x the 32 outputs of two neighbouring panels, one 16-wide
// vector per panel and row (2 * ROWS accumulators), each of the two panels' weights loaded once per tile.
// Each output sums in the same order as in `panel_tile`, so both give the same values. On a two-core AVX-512
// machine, SmolLM2's linears at 16-256 rows: `panel_tile` on 8-wide vectors 113-119 GFLOP/s (one shape, one run), this
// at 6 / 8 / 12 rows a tile 159-223 / 181-230 / 219-295 (best of four alternating processes; torch's probe: 226-262).
// `next` (the panels of the unit a thread takes next) is prefetched into L2 only (`prefetch_l2`).
template <int ROWS, typename W = float>
static inline void panel_tile16(const float* xp, int64_t k, const W* panel, const W* second, float* yp, int64_t ldy,
                                int64_t cols2, const float* bias, const W* next) {
  v16 a[ROWS], b[ROWS];
  for (int r = 0; r < ROWS; ++r) a[r] = b[r] = v16{};
  for (int64_t c = 0; c < k; ++c) {
    const v16 w = load16(panel + c * PANEL), u = load16(second + c * PANEL);
    if (next && (sizeof(W) == 4 || c % 2 == 0)) {  // (a line a row of fp32 panels, two of 16-bit ones)
      prefetch_l2(next + c * PANEL);
      prefetch_l2(next + (k + c) * PANEL);
    }
    for (int r = 0; r < ROWS; ++r) {
      const float s = xp[r * k + c];
      a[r] = madd(s, w, a[r]);
      b[r] = madd(s, u, b[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    store_panel(reinterpret_cast<const v8*>(&a[r]), yp + r * ldy, PANEL, bias);
    store_panel(reinterpret_cast<const v8*>(&b[r]), yp + r * ldy + PANEL, cols2, bias ? bias + PANEL : nullptr);
  }
}

// `panel_tile16` for 1 to R rows (`second`: the other panel, which a packed linear's next one is).
template <int R, typename W = float>
static inline void panel_tile16_rows(int64_t rows, const float* xp, int64_t k, const W* panel, const W* second,
                                     float* yp, int64_t ldy, int64_t cols2, const float* bias, const W* next) {
  if constexpr (R > 1)
    if (rows < R) return panel_tile16_rows<R - 1, W>(rows, xp, k, panel, second, yp, ldy, cols2, bias, next);
  panel_tile16<R>(xp, k, panel, second, yp, ldy, cols2, bias, next);
}

// ROWS rows (one to three) x NP neighbouring panels (bf16 or fp16) on 512-bit vectors, into t (`ldt` floats a row, the
// outputs of panel q at q * 16): each panel's 16 weights widened once, ROWS * NP accumulator chains. At one row
// with two chains (`panel_pair`), a bf16 pass ran barely faster than fp32's (59-61 against 52-55 tok/s, SmolLM2
// one stream); with eight, 90-97 against 63-67. The same sums in the same order as `panel_tile16`: a row's
// outputs do not depend on the rows computed with it.
template <int ROWS, int NP, typename W>
static inline void panel_few(const float* xp, int64_t k, const W* panel, float* t, int64_t ldt) {
  v16 acc[ROWS][NP];
  for (int r = 0; r < ROWS; ++r)
    for (int q = 0; q < NP; ++q) acc[r][q] = v16{};
  for (int64_t c = 0; c < k; ++c) {
    v16 w[NP];
    for (int q = 0; q < NP; ++q) w[q] = load16(panel + q * k * PANEL + c * PANEL);
    for (int r = 0; r < ROWS; ++r) {
      const float s = xp[r * k + c];
      for (int q = 0; q < NP; ++q) acc[r][q] = madd(s, w[q], acc[r][q]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int q = 0; q < NP; ++q) std::memcpy(t + r * ldt + q * PANEL, &acc[r][q], sizeof acc[r][q]);
}

// `panel_few` for 1 to 3 rows and `count` (at most 8) panels: eight at once, else one at a time.
template <typename W>
static inline void panel_few_rows(int64_t rows, int64_t count, const float* xp, int64_t k, const W* panel, float* t,
                                  int64_t ldt) {
  constexpr int NP = 8;  // (24 accumulators and 8 weights of the 32 registers at three rows)
  if (count == NP) {
    if (rows == 3) panel_few<3, NP>(xp, k, panel, t, ldt);
    else if (rows == 2) panel_few<2, NP>(xp, k, panel, t, ldt);
    else panel_few<1, NP>(xp, k, panel, t, ldt);
    return;
  }
  for (int64_t q = 0; q < count; ++q) {
    if (rows == 3) panel_few<3, 1>(xp, k, panel + q * k * PANEL, t + q * PANEL, ldt);
    else if (rows == 2) panel_few<2, 1>(xp, k, panel + q * k * PANEL, t + q * PANEL, ldt);
    else panel_few<1, 1>(xp, k, panel + q * k * PANEL, t + q * PANEL, ldt);
  }
}

#endif
