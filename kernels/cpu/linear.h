// Part of the kernels' one translation unit: cpu_kernels.cpp includes the parts in order, each using those
// before it. This one: the gated activation and a linear layer's rows through its panels (`panel_rows`, `panel_linear`).
#pragma once

// A gated MLP's activation of its gate: SiLU (Llama and most), GeLU's tanh approximation (Gemma's
// gelu_pytorch_tanh).
enum Activation : int64_t { SILU = 0, GELU_TANH = 1 };

// Both as g / (1 + exp(z)), z at most 80 (past it the result is 0 to float precision either way). GeLU's tanh
// approximation: 0.5 g (1 + tanh(u)), u = sqrt(2 / pi) (g + 0.044715 g^3), as torch computes it, written as
// g / (1 + exp(-2u)): the same function (1 + tanh(u) = 2 / (1 + exp(-2u))), through the same exp.
static inline vw activation(vw g, int64_t act) {
  vw z = -g;
  if (act == GELU_TANH) z = -2.f * (0.7978845608028654f * (g + 0.044715f * g * g * g));
  const vw cap = vw{} + 80.f;
  return g / (1.f + expw(z < cap ? z : cap));
}

// o[i] = act(g[i]) * u[i] for n outputs.
static inline void gate_times_up(const float* g, const float* u, int64_t n, float* o, int64_t act) {
  int64_t i = 0;
  for (; i + WIDE <= n; i += WIDE) storew(o + i, activation(loadw(g + i), act) * loadw(u + i));
  if (i < n) storew_part(o + i, activation(loadw_part(g + i, n - i, 0.f), act) * loadw_part(u + i, n - i, 0.f), n - i);
}

// act(gate) * up for `rows` rows of a tile through a gate panel and its up panel: t holds each row's 16 gate
// outputs then its 16 up outputs; the same arithmetic as `gated_rows`.
static inline void gated_store(const float* t, int64_t rows, float* y, int64_t ldy, int64_t act) {
  for (int64_t r = 0; r < rows; ++r) gate_times_up(t + r * 2 * PANEL, t + r * 2 * PANEL + PANEL, PANEL, y + r * ldy, act);
}

// y += a over a tile's rows x cols (both `ld` floats a row): the residual added where the tile was just stored.
static inline void add_tile(float* y, const float* a, int64_t rows, int64_t cols, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r)
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) y[r * ld + c] += a[r * ld + c];
}

// y = x @ w.T (+ b) ([M, K] -> [M, N]) over `pack_panels` weights. Threads split the panels; rows go through
// in tiles of up to 6 (12 accumulators), blocks of rows sized so that x stays in L2 while a panel is reused
// (with 512-bit vectors, more than three rows take the tiles of `panel_tile16` instead).
// With gated weights (`pack_panels_gated`) y is [M, N / 2], act(gate) * up (`gated_store`, tile by tile).
// `add` ([M, N] like y), where given, is added to each tile as soon as it is stored (a decoder layer's residual,
// without a pass of its own: a 20-decode + 236-token step of SmolLM2 184 -> 178-182 ms, the same process
// alternating); not with gated weights.
#include "bf16.h"

template <typename W>
static void panel_rows_of(const float* xp, int64_t m, const Panels& w, const W* pp, float* yp, bool small, const float* add);

static void panel_rows(const float* xp, int64_t m, const Panels& w, float* yp, bool small, const float* add = nullptr) {
  TORCH_CHECK(!(add && w.gated), "panel_rows: no residual with gated weights");
  if (w.vn) return vnni_rows(xp, m, w, yp, small, add);
  if (w.q || w.a8) {
    if (w.q) qpanel_rows(xp, m, w, yp, small);
    else a8_rows(xp, m, w, yp, small);
    if (add) add_tile(yp, add, m, w.n, w.n);
    return;
  }
  if (w.h) panel_rows_of(xp, m, w, w.h, yp, small, add);
  else if (w.f16) panel_rows_of(xp, m, w, w.f16, yp, small, add);
  else panel_rows_of(xp, m, w, w.p, yp, small, add);
}

#ifdef __AVX512F__
// `panel_rows` for one to three rows of bf16 or fp16 panels: groups of eight panels a task through `panel_few`, each
// group's outputs stored from the tile (the bias added, gated or the residual added as `panel_rows` does).
template <typename W>
static void panel_rows_few(const float* xp, int64_t m, const Panels& w, const W* pp, float* yp, bool small, const float* add) {
  constexpr int64_t NP = 8;
  const int64_t k = w.k, n = w.n, ny = w.gated ? n / 2 : n, panels = (n + PANEL - 1) / PANEL;
  parallel((panels + NP - 1) / NP, 1, small, [&](int64_t begin, int64_t end) {
    float t[3 * NP * PANEL];
    for (int64_t g = begin; g < end; ++g) {
      const int64_t p = g * NP, count = std::min(NP, panels - p), j = p * PANEL;
      panel_few_rows(m, count, xp, k, pp + p * k * PANEL, t, NP * PANEL);
      for (int64_t r = 0; r < m; ++r)
        for (int64_t q = 0; q < count; q += w.gated ? 2 : 1) {
          const float* row = t + r * NP * PANEL + q * PANEL;
          const float* b = w.bias ? w.bias + j + q * PANEL : nullptr;
          if (w.gated) {
            float both[2 * PANEL];
            store_panel(reinterpret_cast<const v8*>(row), both, PANEL, b);
            store_panel(reinterpret_cast<const v8*>(row + PANEL), both + PANEL, PANEL, b ? b + PANEL : nullptr);
            gated_store(both, 1, yp + r * ny + (j + q * PANEL) / 2, ny, w.act);
          } else {
            const int64_t cols = std::min(PANEL, n - j - q * PANEL);
            float* y = yp + r * n + j + q * PANEL;
            store_panel(reinterpret_cast<const v8*>(row), y, cols, b);
            if (add) add_tile(y, add + r * n + j + q * PANEL, 1, cols, n);
          }
        }
    }
  });
}
#endif

// `panel_rows` over fp32, bf16 or fp16 panels (W: float, uint16_t or at::Half).
template <typename W>
static void panel_rows_of(const float* xp, int64_t m, const Panels& w, const W* pp, float* yp, bool small, const float* add) {
  constexpr int64_t TILE = 6;
  const int64_t k = w.k, n = w.n, ny = w.gated ? n / 2 : n;  // ny: the outputs a row
  const float* bias = w.bias;
  const int64_t panels = (n + PANEL - 1) / PANEL;
  const int64_t rows_per_block = std::max<int64_t>(TILE, (262144 / (4 * k)) / TILE * TILE);
#ifdef __AVX512F__
  if constexpr (sizeof(W) == 2)  // (fp32 panels through it: 66-70 against 63-67 tok/s, within the noise)
    if (m <= 3) return panel_rows_few(xp, m, w, pp, yp, small, add);
  if (m > 3) {
    // Pairs of panels through 16-wide vectors, in one parallel region: each unit of work is one block of
    // rows (x stays in L2) times one pair of panels, block after block. Each thread works through its own
    // run of units, prefetching the next one's panels, then takes what is left of the others' runs. (Split
    // in equal shares per block, the faster core waited for the slower one at every block: 11% of a prefill
    // step's samples in OpenMP's barrier.)
    constexpr int64_t TILE16 = 12;  // 24 accumulators of the 32 registers
    // Weights larger than half the L3 are read again from memory for every block of rows: there up to 96 rows go
    // in one block whatever x's width (x then read from L3 for each pair). A 1.1B model's layer at 32 / 64 rows:
    // 9.7-9.8 -> 7.1 and 16.9-18.4 -> 13.5 ms (its down projection's weights had been read three to six times).
    // Smaller weights are read again from L3: SmolLM2's at 64 rows ran 3% slower in one block (three alternating runs).
    const bool streamed = k * n * (int64_t)sizeof(W) > (16 << 20);
    const int64_t few = streamed ? (std::min<int64_t>(m, 96) + TILE16 - 1) / TILE16 * TILE16 : TILE16;
    const int64_t rows16 = std::max<int64_t>(few, rows_per_block / TILE16 * TILE16);
    const int64_t pairs = panels / 2, units = (m + rows16 - 1) / rows16 * pairs;
    const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), units));
    std::vector<std::atomic<int64_t>> taken(threads);  // run t is units [units * t / threads, units * (t + 1) / threads)
    for (int64_t t = 0; t < threads; ++t) taken[t].store(units * t / threads, std::memory_order_relaxed);
    parallel(threads, 1, small, [&](int64_t begin, int64_t) {
      for (int64_t i = 0; i < threads; ++i) {
        const int64_t t = (begin + i) % threads, end = units * (t + 1) / threads;
        for (int64_t u; (u = taken[t].fetch_add(1, std::memory_order_relaxed)) < end;) {
          const int64_t first = u / pairs * rows16, last = std::min(m, first + rows16), p = 2 * (u % pairs);
          const W* panel = pp + p * k * PANEL;
          const float* b = bias ? bias + p * PANEL : nullptr;
          const int64_t j = p * PANEL, cols2 = std::min(PANEL, n - j - PANEL);
          const W* next = u + 1 < end ? pp + 2 * ((u + 1) % pairs) * k * PANEL : nullptr;
          for (int64_t r = first; r < last; r += TILE16) {
            const int64_t rows = std::min(TILE16, last - r);
            if (w.gated) {
              float t[TILE16 * 2 * PANEL];
              panel_tile16_rows<TILE16, W>(rows, xp + r * k, k, panel, panel + k * PANEL, t, 2 * PANEL, PANEL, b,
                                        r == first ? next : nullptr);
              gated_store(t, rows, yp + r * ny + j / 2, ny, w.act);
            } else {
              panel_tile16_rows<TILE16, W>(rows, xp + r * k, k, panel, panel + k * PANEL, yp + r * n + j, n, cols2, b,
                                        r == first ? next : nullptr);
              if (add) add_tile(yp + r * n + j, add + r * n + j, rows, PANEL + cols2, n);
            }
          }
        }
      }
    });
    if (panels % 2) {  // the odd one left, on this thread
      const int64_t j = (panels - 1) * PANEL;
      for (int64_t r = 0; r < m; r += TILE) {
        panel_tile_rows<W>(std::min(TILE, m - r), xp + r * k, k, pp + (panels - 1) * k * PANEL, yp + r * n + j, n,
                        n - j, bias ? bias + j : nullptr, nullptr);
        if (add) add_tile(yp + r * n + j, add + r * n + j, std::min(TILE, m - r), n - j, n);
      }
    }
    return;
  }
#endif
  if (w.gated) {  // a gate panel and its up panel a task, as `panel_pair` (up to three rows) or two `panel_tile`s
    for (int64_t first = 0; first < m; first += rows_per_block) {
      const int64_t last = std::min(m, first + rows_per_block);
      parallel(panels / 2, 1, small, [&](int64_t begin, int64_t end) {
        float t[TILE * 2 * PANEL];
        for (int64_t i = begin; i < end; ++i) {
          const W* panel = pp + 2 * i * k * PANEL;
          const float* b = bias ? bias + 2 * i * PANEL : nullptr;
          const W* next = i + 1 < end ? panel + 2 * k * PANEL : nullptr;
          for (int64_t r = first; r < last; r += TILE) {
            const int64_t rows = std::min(TILE, last - r);
            if (rows == 3) panel_pair<3, W>(xp + r * k, k, panel, t, 2 * PANEL, PANEL, b);
            else if (rows == 2) panel_pair<2, W>(xp + r * k, k, panel, t, 2 * PANEL, PANEL, b);
            else if (rows == 1) panel_pair<1, W>(xp + r * k, k, panel, t, 2 * PANEL, PANEL, b);
            else {
              panel_tile_rows<W>(rows, xp + r * k, k, panel, t, 2 * PANEL, PANEL, b, r == first ? next : nullptr);
              panel_tile_rows<W>(rows, xp + r * k, k, panel + k * PANEL, t + PANEL, 2 * PANEL, PANEL, b ? b + PANEL : nullptr,
                              r == first && next ? next + k * PANEL : nullptr);
            }
            gated_store(t, rows, yp + r * ny + i * PANEL, ny, w.act);
          }
        }
      });
    }
    return;
  }
  for (int64_t first = 0; first < m; first += rows_per_block) {
    const int64_t last = std::min(m, first + rows_per_block);
    parallel(panels, 1, small, [&](int64_t begin, int64_t end) {
      int64_t p = begin;
      if (last - first <= 3) {  // up to three rows: panels in pairs
        for (; p + 1 < end; p += 2) {
          const W* panel = pp + p * k * PANEL;
          const float* b = bias ? bias + p * PANEL : nullptr;
          float* y = yp + first * n + p * PANEL;
          const int64_t cols2 = std::min(PANEL, n - (p + 1) * PANEL);
          if (last - first == 3)
            panel_pair<3, W>(xp + first * k, k, panel, y, n, cols2, b);
          else if (last - first == 2)
            panel_pair<2, W>(xp + first * k, k, panel, y, n, cols2, b);
          else
            panel_pair<1, W>(xp + first * k, k, panel, y, n, cols2, b);
          if (add) add_tile(y, add + first * n + p * PANEL, last - first, PANEL + cols2, n);
        }
      }
      for (; p < end; ++p) {
        const W* panel = pp + p * k * PANEL;
        const int64_t j = p * PANEL, cols = std::min(PANEL, n - j);
        const float* b = bias ? bias + j : nullptr;
        for (int64_t r = first; r < last; r += TILE) {
          // the first tile brings the next panel into cache while it computes
          const W* next = r == first && p + 1 < end ? panel + k * PANEL : nullptr;
          panel_tile_rows<W>(std::min(TILE, last - r), xp + r * k, k, panel, yp + r * n + j, n, cols, b, next);
          if (add) add_tile(yp + r * n + j, add + r * n + j, std::min(TILE, last - r), cols, n);
        }
      }
    });
  }
}

static Panels panels_of(const torch::Tensor& packed, int64_t n, const torch::Tensor& bias, bool gated = false,
                        int64_t act = SILU) {
  Panels w;
  if (packed.scalar_type() == torch::kByte) {  // `pack_panels_w8a8`
    const int64_t k = (packed.size(1) - PANEL * 4) / (PANEL + PANEL * 4 / A8_BLOCK);
    TORCH_CHECK(packed.is_contiguous() && packed.dim() == 2 && packed.size(0) * PANEL >= n && k % A8_BLOCK == 0 &&
                w8a8_width(k) == packed.size(1), "panel_linear: w8a8 weights from pack_panels_w8a8");
    w = Panels{nullptr, nullptr, n, k};
    w.a8 = packed.data_ptr<uint8_t>();
  } else if (packed.scalar_type() == torch::kChar) {  // `pack_panels_int8`
    TORCH_CHECK(packed.is_contiguous() && packed.dim() == 2 && packed.size(0) * PANEL >= n && packed.size(1) % PANEL == 0 &&
                packed.size(1) > PANEL * 4, "panel_linear: int8 weights from pack_panels_int8");
    w = Panels{nullptr, nullptr, n, (packed.size(1) - PANEL * 4) / PANEL, packed.data_ptr<int8_t>()};
  } else if (packed.dim() == 4) {  // `vnni_panels`
    TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == torch::kBFloat16 && packed.size(2) == PANEL &&
                packed.size(3) == 2 && packed.size(0) * PANEL >= n && packed.size(1) * 2 % BF16_BLOCK == 0,
                "panel_linear: bf16 compute's weights from vnni_panels");
    w = Panels{nullptr, nullptr, n, packed.size(1) * 2};
    w.vn = data_of<uint16_t>(packed);
  } else {
    const auto dtype = packed.scalar_type();
    TORCH_CHECK(packed.is_contiguous() && packed.dim() == 3 && packed.size(2) == PANEL && packed.size(0) * PANEL >= n &&
                panel_dtype(packed) == dtype && reinterpret_cast<uintptr_t>(packed.data_ptr()) % 32 == 0,
                "panel_linear: weights from pack_panels");
    w = Panels{nullptr, nullptr, n, packed.size(1)};
    if (dtype == torch::kBFloat16) w.h = data_of<uint16_t>(packed);
    else if (dtype == torch::kHalf) w.f16 = data_of<at::Half>(packed);
    else w.p = packed.data_ptr<float>();
  }
  if (bias.defined() && bias.numel() > 0) {
    TORCH_CHECK(bias.is_contiguous() && bias.numel() == n && bias.scalar_type() == torch::kFloat,
                "panel_linear: one fp32 bias per output feature");
    w.bias = bias.data_ptr<float>();
  }
  TORCH_CHECK(!gated || (!w.q && !w.a8 && n % (2 * PANEL) == 0), "panel_linear: gated weights from pack_panels_gated");
  TORCH_CHECK(act == SILU || act == GELU_TANH, "panel_linear: activation 0 (SiLU) or 1 (GeLU, tanh)");
  w.gated = gated;
  w.act = act;
  return w;
}

// x [M, K] -> [M, N] through weights packed by `pack_panels` (n: their output features); `gated`: weights from
// `pack_panels_gated` (n: gate's and up's features together, the bias in their panels' order) -> [M, N / 2],
// `act` (`Activation`) of the gate times up.
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> b, bool gated,
                           int64_t act) {
  const Panels w = panels_of(packed, n, b.has_value() ? *b : torch::Tensor(), gated, act);
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == torch::kFloat && x.dim() == 2 && x.size(1) == w.k,
              "panel_linear: contiguous fp32 [M, K]");
  auto y = torch::empty({x.size(0), gated ? n / 2 : n}, x.options());
  panel_rows(x.data_ptr<float>(), x.size(0), w, y.data_ptr<float>(), x.size(0) <= 2);
  return y;
}
