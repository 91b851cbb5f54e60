// bf16 compute (`EngineConfig.compute="bf16"`): a linear layer's rows rounded to bfloat16 (to nearest even), times
// bf16 weights, each output summed in fp32; fp32 outputs (the bias, a gated MLP's activation and the residual added
// in fp32 as `panel_rows` adds them). Included by cpu/linear.h, after `Panels`, `parallel` and `gate_times_up`.
//
// Weights: `vnni_panels` re-lays `pack_panels` (or `pack_panels_gated`) bf16 panels as [P, K / 2, 16, 2], K the
// input width (a multiple of 32): within a panel each pair of inputs holds its 16 output features' two weights
// side by side, the layout of an AMX tile's second operand and of `vdpbf16ps`'s (which multiply pairs).
//
// Which unit computes is chosen when the kernels load, from what the CPU reports (CPUID) and what the OS allows
// (Linux grants a process AMX's tile state on request), not from what the compiler targeted; `bf16_unit(...)`
// forces a lesser one (the tests compare them):
// - "amx": AMX-BF16 tiles, 32 rows x 32 outputs (two panels) a tile step of 32 inputs.
// - "avx512-bf16": `vdpbf16ps`, one row at a time over two panels.
// - "portable": plain C++ over the same layout (any CPU; slow, for correctness where neither is there).
// - "amx-emulated": AMX's code on tiles emulated in plain C++ (any CPU; slow, for the tests, set by name only).
// Every unit computes each row alone, its inputs in order (a pair at a time; within a pair, or a tile's step, in the
// unit's own order), so a row's outputs do not depend on the other rows of its batch; the units agree to float
// rounding (the products are exact in fp32: a bf16 value has 8 significant bits).

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#define BF16_X86 1  // the AVX512-BF16 and AMX units (target attributes; the OS's permission asked for as Linux asks)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#else
#define BF16_X86 0
#endif

constexpr int64_t BF16_BLOCK = 32;  // inputs a tile step (K a multiple of it)

enum Bf16Unit : int64_t { BF16_PORTABLE = 0, BF16_AVX512 = 1, BF16_AMX = 2, BF16_AMX_EMULATED = 3 };

static inline uint16_t bf16_of(float x) {  // to nearest even, as torch rounds (a NaN stays a NaN)
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}

static inline float float_of_bf16(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// Why AMX's tiles do not compute ("" where they do), in words: set as the kernels load.
static std::string bf16_not_amx;

// The best unit this CPU and OS offer.
static Bf16Unit best_bf16_unit() {
  bf16_not_amx = "the CPU has no AMX-BF16";
#if BF16_X86
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return BF16_PORTABLE;
  const bool avx512 = (b & (1u << 16)) && (b & (1u << 30));  // AVX512F, AVX512BW
  const bool amx = (d & (1u << 24)) && (d & (1u << 22));  // AMX-TILE, AMX-BF16
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  const bool avx512_bf16 = avx512 && __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) && (a1 & (1u << 5));
  unsigned a2 = 0, b2 = 0, c2 = 0, d2 = 0, lo = 0, hi = 0;
  const bool osxsave = __get_cpuid(1, &a2, &b2, &c2, &d2) && (c2 & (1u << 27));  // (leaf 1's, not leaf 7's bit 27)
  if (osxsave) __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));  // the OS's enabled state
  const bool zmm = (lo & 0xe6u) == 0xe6u;  // the OS saves the 512-bit registers
  if (amx && !(avx512 && zmm)) bf16_not_amx = "the OS does not enable AVX-512's registers";
  if (amx && avx512 && zmm) {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0) {
      bf16_not_amx.clear();
      return BF16_AMX;
    }
    bf16_not_amx = std::string("the OS refused the tile state (arch_prctl: ") + std::strerror(errno) + ")";
  }
  if (avx512_bf16 && zmm) return BF16_AVX512;
#endif
  return BF16_PORTABLE;
}

static const Bf16Unit bf16_best = best_bf16_unit();
static std::atomic<int64_t> bf16_chosen{bf16_best};

// Rows x [M, K] rounded to bf16 into a [M, K].
static void bf16_rows(const float* x, int64_t m, int64_t k, uint16_t* a, bool small) {
  parallel(m * k, 16384, small, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) a[i] = bf16_of(x[i]);
  });
}

// One or two panels (b1 null: one) times `rows` rows of a: c [rows, 32] (the second panel's outputs in columns
// 16-31), each output's sum over the KP inputs.
static void portable_pair(const uint16_t* a, int64_t k, int64_t rows, const uint16_t* b0, const uint16_t* b1, float* c) {
  for (int64_t r = 0; r < rows; ++r)
    for (int which = 0; which < (b1 ? 2 : 1); ++which) {
      const uint16_t* b = which ? b1 : b0;
      float acc[PANEL] = {};
      for (int64_t i = 0; i < k / 2; ++i) {
        const float a0 = float_of_bf16(a[r * k + 2 * i]), a1 = float_of_bf16(a[r * k + 2 * i + 1]);
        for (int64_t j = 0; j < PANEL; ++j)
          acc[j] = acc[j] + a0 * float_of_bf16(b[i * 2 * PANEL + 2 * j]) + a1 * float_of_bf16(b[i * 2 * PANEL + 2 * j + 1]);
      }
      std::memcpy(c + r * 2 * PANEL + which * PANEL, acc, sizeof acc);
    }
}

#if BF16_X86
#define BF16_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// `portable_pair` through `vdpbf16ps` for up to ROWS rows: each row's pair of inputs broadcast against the
// panels' 16 pairs, each panel's pairs loaded once for all the rows.
template <int ROWS>
BF16_AVX512_TARGET static void avx512_tile(const uint16_t* a, int64_t k, int64_t rows, const uint16_t* b0,
                                           const uint16_t* b1, float* c) {
  __m512 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k / 2; ++i) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(b0 + i * 2 * PANEL);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512((b1 ? b1 : b0) + i * 2 * PANEL);
    for (int r = 0; r < ROWS; ++r) {
      if (r >= rows) break;
      int32_t pair;
      std::memcpy(&pair, a + r * k + 2 * i, 4);
      const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, w1);  // (b1 null: discarded)
    }
  }
  for (int r = 0; r < ROWS && r < rows; ++r) {
    _mm512_storeu_ps(c + r * 2 * PANEL, acc[r][0]);
    _mm512_storeu_ps(c + r * 2 * PANEL + PANEL, acc[r][1]);
  }
}

BF16_AVX512_TARGET static void avx512_pair(const uint16_t* a, int64_t k, int64_t rows, const uint16_t* b0,
                                           const uint16_t* b1, float* c) {
  constexpr int ROWS = 8;  // 16 accumulators
  for (int64_t r = 0; r < rows; r += ROWS)
    avx512_tile<ROWS>(a + r * k, k, std::min<int64_t>(ROWS, rows - r), b0, b1, c + r * 2 * PANEL);
}

#endif

// AMX: eight tile registers of up to 16 rows of 64 bytes, shaped by `ldtilecfg`; `tdpbf16ps c, a, b` adds to tile c
// (M rows of N fp32 sums) the products of tile a (M rows of K pairs of bf16) and tile b (K rows of N pairs).
// `amx_pair` is written once over these operations and runs on the CPU's tiles (`AmxTiles`) or on `EmulatedTiles`:
// plain C++ doing what Intel's reference says each instruction does, the unit "amx-emulated" (offered on every CPU,
// slow: the tests run AMX's own code, its layout, strides and tile shapes, where the CPU has no AMX).

struct alignas(64) TileConfig {  // `ldtilecfg`'s 64 bytes (palette 1)
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The tiles in plain C++. `tdpbf16ps` as Intel's reference (SDM, 2023 on) gives it: each output's products of even
// and of odd inputs summed apart over the tile's K pairs (fused multiply-adds, rounded to nearest even; inputs
// below fp32's normal range read as zero, results there flushed to zero), then the two sums added and that added to
// the output. What the CPU would refuse (#UD: a tile not configured, shapes that do not chain) ends the process, as
// the CPU's SIGILL would, with a line that says why.
struct EmulatedTiles {
  TileConfig shape;  // as configured (0 rows: a tile not configured)
  alignas(64) uint8_t tile[8][16][64];

  [[noreturn]] static void fault(const char* what) {
    std::fprintf(stderr, "amx-emulated: %s would fault (#UD)\n", what);
    std::abort();
  }
  static float flushed(float x) { return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x; }  // to 0
  bool usable(int t) const { return t >= 0 && t < 8 && shape.rows[t] > 0 && shape.colsb[t] > 0; }
  float sum(int t, int r, int j) const {
    float x;
    std::memcpy(&x, tile[t][r] + 4 * j, 4);
    return x;
  }
  float half(int t, int r, int i) const {  // the i-th bf16 of row r
    uint16_t h;
    std::memcpy(&h, tile[t][r] + 2 * i, 2);
    return flushed(float_of_bf16(h));
  }

  void configure(const TileConfig& config) {
    if (config.palette != 1) fault("ldtilecfg (a palette other than 1)");
    for (int t = 0; t < 8; ++t)
      if (config.rows[t] > 16 || config.colsb[t] > 64 || config.colsb[t] % 4) fault("ldtilecfg (a tile's shape)");
    shape = config;
    std::memset(tile, 0, sizeof tile);
  }
  void release() {  // (every tile unconfigured again)
    shape = TileConfig{};
    shape.palette = 0;
  }
  void zero(int t) {
    if (!usable(t)) fault("tilezero (a tile not configured)");
    std::memset(tile[t], 0, sizeof tile[t]);
  }
  void load(int t, const void* p, int64_t stride) {
    if (!usable(t)) fault("tileloadd (a tile not configured)");
    std::memset(tile[t], 0, sizeof tile[t]);
    for (int r = 0; r < shape.rows[t]; ++r) std::memcpy(tile[t][r], (const char*)p + r * stride, shape.colsb[t]);
  }
  void store(int t, void* p, int64_t stride) const {
    if (!usable(t)) fault("tilestored (a tile not configured)");
    for (int r = 0; r < shape.rows[t]; ++r) std::memcpy((char*)p + r * stride, tile[t][r], shape.colsb[t]);
  }
  void dot(int c, int a, int b) {
    if (!usable(c) || !usable(a) || !usable(b) || c == a || c == b || a == b) fault("tdpbf16ps (its tiles)");
    const int m = shape.rows[c], k = shape.colsb[a] / 4, n = shape.colsb[c] / 4;
    if (shape.rows[a] != m || shape.rows[b] != k || shape.colsb[b] != shape.colsb[c])
      fault("tdpbf16ps (shapes that do not chain)");
    for (int r = 0; r < m; ++r)
      for (int j = 0; j < n; ++j) {
        float even = 0, odd = 0;
        for (int i = 0; i < k; ++i) {
          even = flushed(std::fma(half(a, r, 2 * i), half(b, i, 2 * j), even));
          odd = flushed(std::fma(half(a, r, 2 * i + 1), half(b, i, 2 * j + 1), odd));
        }
        const float y = flushed(sum(c, r, j) + flushed(even + odd));
        std::memcpy(tile[c][r] + 4 * j, &y, 4);
      }
  }
};

#if BF16_X86
// The CPU's tiles. An instruction names its tiles in the code (GCC's intrinsics are assembly with the number
// written in): one case a tile, folded away where `amx_pair`'s literal numbers are inlined.
#define AMX_EACH_TILE(t, OP, ...)                                                                                  \
  switch (t) {                                                                                                     \
    case 0: OP(0, ##__VA_ARGS__); break;                                                                           \
    case 1: OP(1, ##__VA_ARGS__); break;                                                                           \
    case 2: OP(2, ##__VA_ARGS__); break;                                                                           \
    case 3: OP(3, ##__VA_ARGS__); break;                                                                           \
    case 4: OP(4, ##__VA_ARGS__); break;                                                                           \
    case 5: OP(5, ##__VA_ARGS__); break;                                                                           \
    case 6: OP(6, ##__VA_ARGS__); break;                                                                           \
    default: OP(7, ##__VA_ARGS__); break;                                                                          \
  }

struct AmxTiles {
  // (not `_tile_loadconfig`: GCC 12's tells the compiler it reads the first 8 bytes only, so the stores of the
  // rest may be dropped, the tiles left unconfigured, and the first tile instruction faults)
  static void configure(const TileConfig& config) { __asm__ volatile("ldtilecfg %0" : : "m"(config) : "memory"); }
  static void release() { __asm__ volatile("tilerelease" ::: "memory"); }
  __attribute__((always_inline)) static inline void zero(int t) { AMX_EACH_TILE(t, _tile_zero) }
  __attribute__((always_inline)) static inline void load(int t, const void* p, int64_t stride) {
    AMX_EACH_TILE(t, _tile_loadd, p, stride)
  }
  __attribute__((always_inline)) static inline void store(int t, void* p, int64_t stride) {
    AMX_EACH_TILE(t, _tile_stored, p, stride)
  }
  __attribute__((always_inline)) static inline void dot(int c, int a, int b) {  // the four products of `amx_pair`
    if (c == 0 && a == 4 && b == 6) _tile_dpbf16ps(0, 4, 6);
    else if (c == 1 && a == 4 && b == 7) _tile_dpbf16ps(1, 4, 7);
    else if (c == 2 && a == 5 && b == 6) _tile_dpbf16ps(2, 5, 6);
    else if (c == 3 && a == 5 && b == 7) _tile_dpbf16ps(3, 5, 7);
    else __builtin_trap();
  }
};
#undef AMX_EACH_TILE
#endif

// Every tile 16 rows of 64 bytes: 0-3 the sums (rows 0-15 / 16-31 x panel 0 / 1), 4-5 rows of a, 6-7 a step of the
// panels (16 pairs of inputs x 16 outputs).
template <class Tiles>
static void amx_configure(Tiles& tiles) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  tiles.configure(config);
}

// `portable_pair` through tiles, rows 16 or 32 (a holds them, zeros past the batch's rows), 32 inputs a step.
template <bool ROWS32, bool TWO, class Tiles>
static inline void amx_pair(Tiles& t, const uint16_t* a, int64_t k, const uint16_t* b0, const uint16_t* b1, float* c) {
  t.zero(0);
  if (TWO) t.zero(1);
  if (ROWS32) t.zero(2);
  if (ROWS32 && TWO) t.zero(3);
  const int64_t lda = k * 2;
  for (int64_t kb = 0; kb < k; kb += BF16_BLOCK) {
    t.load(4, a + kb, lda);
    t.load(6, b0 + kb * PANEL, 64);
    t.dot(0, 4, 6);
    if (TWO) {
      t.load(7, b1 + kb * PANEL, 64);
      t.dot(1, 4, 7);
    }
    if (ROWS32) {
      t.load(5, a + 16 * k + kb, lda);
      t.dot(2, 5, 6);
      if (TWO) t.dot(3, 5, 7);
    }
  }
  t.store(0, c, 2 * PANEL * 4);
  if (TWO) t.store(1, c + PANEL, 2 * PANEL * 4);
  if (ROWS32) t.store(2, c + 16 * 2 * PANEL, 2 * PANEL * 4);
  if (ROWS32 && TWO) t.store(3, c + 16 * 2 * PANEL + PANEL, 2 * PANEL * 4);
}

template <class Tiles>
static void amx_rows(Tiles& t, const uint16_t* a, int64_t k, int64_t rows, const uint16_t* b0, const uint16_t* b1,
                     float* c) {
  if (rows > 16 && b1) amx_pair<true, true>(t, a, k, b0, b1, c);
  else if (rows > 16) amx_pair<true, false>(t, a, k, b0, b1, c);
  else if (b1) amx_pair<false, true>(t, a, k, b0, b1, c);
  else amx_pair<false, false>(t, a, k, b0, b1, c);
}

// One unit of `vnni_rows`: rows [r, r + rows) (rows <= 32) of a through panels p and p + 1 (b1 null: p alone) into c.
static void bf16_pair(int64_t unit, EmulatedTiles& emulated, const uint16_t* a, int64_t k, int64_t rows,
                      const uint16_t* b0, const uint16_t* b1, float* c) {
  if (unit == BF16_AMX_EMULATED) return amx_rows(emulated, a, k, rows, b0, b1, c);
#if BF16_X86
  if (unit == BF16_AMX) {
    AmxTiles tiles;
    return amx_rows(tiles, a, k, rows, b0, b1, c);
  }
  if (unit == BF16_AVX512) return avx512_pair(a, k, rows, b0, b1, c);
#endif
  portable_pair(a, k, rows, b0, b1, c);
}

// `panel_rows` over `vnni_panels` weights: threads split the pairs of panels (a gated MLP's gate panel and its up
// panel, or two neighbours); each takes every row, 32 at a time, through the pair.
static void vnni_rows(const float* xp, int64_t m, const Panels& w, float* yp, bool small, const float* add) {
  const int64_t k = w.k, n = w.n, ny = w.gated ? n / 2 : n, panels = (n + PANEL - 1) / PANEL;
  const int64_t mp = (m + 15) / 16 * 16, pairs = (panels + 1) / 2;
  std::unique_ptr<uint16_t[]> a(new uint16_t[mp * k]);
  bf16_rows(xp, m, k, a.get(), small);
  std::fill(a.get() + m * k, a.get() + mp * k, (uint16_t)0);
  const int64_t unit = bf16_chosen.load(std::memory_order_relaxed);
  parallel(pairs, 1, small, [&](int64_t begin, int64_t end) {
    EmulatedTiles emulated;  // ("amx-emulated"'s tiles)
    if (unit == BF16_AMX_EMULATED) amx_configure(emulated);
#if BF16_X86
    AmxTiles tiles;
    if (unit == BF16_AMX) amx_configure(tiles);
#endif
    alignas(64) float c[32 * 2 * PANEL];
    for (int64_t q = begin; q < end; ++q) {
      const int64_t p = 2 * q;
      const uint16_t* b0 = w.vn + p * k * PANEL;
      const uint16_t* b1 = p + 1 < panels ? b0 + k * PANEL : nullptr;
      for (int64_t r = 0; r < m; r += 32) {
        const int64_t rows = std::min<int64_t>(32, m - r);
        bf16_pair(unit, emulated, a.get() + r * k, k, rows, b0, b1, c);
        for (int64_t i = 0; i < rows; ++i) {
          float* t = c + i * 2 * PANEL;
          const float* b = w.bias ? w.bias + p * PANEL : nullptr;
          if (b)
            for (int64_t j = 0; j < (b1 ? 2 : 1) * PANEL && p * PANEL + j < n; ++j) t[j] += b[j];
          if (w.gated) {
            gate_times_up(t, t + PANEL, PANEL, yp + (r + i) * ny + q * PANEL, w.act);
            continue;
          }
          const int64_t cols = std::min<int64_t>(2 * PANEL, n - p * PANEL);
          float* y = yp + (r + i) * n + p * PANEL;
          std::memcpy(y, t, cols * sizeof(float));
          if (add) add_tile(y, add + (r + i) * n + p * PANEL, 1, cols, n);
        }
      }
    }
#if BF16_X86
    if (unit == BF16_AMX) tiles.release();
#endif
  });
}

// bf16 panels from `pack_panels` / `pack_panels_gated` ([P, K, 16], K a multiple of 32) as `vnni_rows` takes them
// ([P, K / 2, 16, 2]), re-laid in place (a view of `packed`'s storage: no second copy while packing).
torch::Tensor vnni_panels(torch::Tensor packed) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == PANEL && packed.scalar_type() == torch::kBFloat16 &&
              packed.is_contiguous() && packed.size(1) % BF16_BLOCK == 0,
              "vnni_panels: bf16 panels from pack_panels, the input width a multiple of 32");
  const int64_t panels = packed.size(0), k = packed.size(1);
  uint16_t* data = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  parallel_pack(panels, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> panel(k * PANEL);  // one panel as it was
    for (int64_t p = begin; p < end; ++p) {
      uint16_t* op = data + p * k * PANEL;
      std::copy(op, op + k * PANEL, panel.begin());
      for (int64_t c = 0; c < k; ++c)
        for (int64_t j = 0; j < PANEL; ++j) op[(c / 2) * 2 * PANEL + 2 * j + c % 2] = panel[c * PANEL + j];
    }
  });
  return packed.view({panels, k / 2, PANEL, 2});
}

static const char* const BF16_UNITS[] = {"portable", "avx512-bf16", "amx", "amx-emulated"};

// The unit bf16 compute runs on (by name); `set`: use that one instead (one the CPU offers, a lesser, or
// "amx-emulated"), returning it.
std::string bf16_unit(c10::optional<std::string> set) {
  if (set.has_value()) {
    int64_t u = -1;
    for (int64_t i = 0; i < 4; ++i)
      if (*set == BF16_UNITS[i]) u = i;
    TORCH_CHECK(u >= 0, "bf16_unit: one of portable, avx512-bf16, amx, amx-emulated, not ", *set);
    TORCH_CHECK(u <= bf16_best || u == BF16_AMX_EMULATED, "bf16_unit: this CPU (or its OS) offers ",
                BF16_UNITS[bf16_best], " at best, not ", *set);
    bf16_chosen.store(u);
  }
  return BF16_UNITS[bf16_chosen.load()];
}

// Why AMX's tiles do not compute on this CPU ("" where they do), in words.
std::string bf16_why_not_amx() { return bf16_not_amx; }
