// Part of the kernels' one translation unit: cpu_kernels.cpp includes the parts in order, each using those
// before it. This one: packed linear weights (`pack_panels`...) and their fp32 / bf16 / fp16 tiles.
#pragma once

// Weights packed in panels of 16 output features for `panel_linear`: [ceil(N / 16), K, 16], each panel
// K-major (the 16 weights of input feature c side by side), the last panel zero-padded.
constexpr int64_t PANEL = 16;

// A linear layer as `pack_panels` left it: its panels, output features and bias (or none). Raw pointers: the
// tensors must outlive it.
struct Panels {
  const float* p = nullptr;
  const float* bias = nullptr;
  int64_t n = 0, k = 0;
  const int8_t* q = nullptr;  // set instead of `p` for `pack_panels_int8` weights
  const uint8_t* a8 = nullptr;  // set instead of `p` for `pack_panels_w8a8` weights (int8 activations too)
  const uint16_t* h = nullptr;  // set instead of `p` for bf16 weights (`pack_panels` over bfloat16 blocks)
  const at::Half* f16 = nullptr;  // likewise for fp16 weights
  const uint16_t* vn = nullptr;  // set instead of `p` for bf16 compute (`vnni_panels` weights, bf16.h)
  bool gated = false;  // `pack_panels_gated` weights: the output is act(gate) * up, n / 2 features
  int64_t act = 0;  // the gate's activation (`Activation`)
};

// Packed weights are carved out of 2 MiB-aligned chunks of at least 32 MiB advised for transparent huge pages
// (where the kernel offers them only on request, as with `madvise` mode): each step streams all the weights,
// and with 4 KiB pages every 4 KiB of them is a TLB miss. Measured on SmolLM2's decoder linears, 2-core machine,
// alternating processes: one row 20.5-21.4 -> 17.9-18.6 ms, 32 rows 55-57 -> 48-49 (the same effect as
// torch's THP_MEM_ALLOC_ENABLE, which a library cannot set for its host process). A chunk is freed when the
// last tensor carved from it is.
struct Chunk {
  Chunk(char* b, size_t s) : base(b), size(s) {}
  Chunk(const Chunk&) = delete;
  ~Chunk() { std::free(base); }
  char* const base;
  const size_t size;
  size_t used = 0;
};

// fn(begin, end) over [0, n) on the pool's threads (`parallel`): for packing, which a forked child may do too, where
// at::parallel_for's OpenMP threads, once started in the parent, would leave the child's first parallel loop waiting.
template <typename F>
static void parallel_pack(int64_t n, const F& fn) {
  parallel(n, 1, true, fn);
}

static torch::Tensor huge_page_tensor(const std::vector<int64_t>& sizes, torch::ScalarType dtype = torch::kFloat) {
  constexpr size_t HUGE_PAGE = 2 << 20, CHUNK = 32 << 20;
  static std::mutex mu;
  static std::weak_ptr<Chunk> current;
  int64_t numel = 1;
  for (int64_t d : sizes) numel *= d;
  const size_t bytes = (numel * torch::elementSize(dtype) + 63) / 64 * 64;
  std::shared_ptr<Chunk> chunk;
  {
    std::lock_guard<std::mutex> lock(mu);
    chunk = current.lock();
    if (!chunk || chunk->used + bytes > chunk->size) {
      const size_t size = std::max(CHUNK, (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE);
      char* base = static_cast<char*>(std::aligned_alloc(HUGE_PAGE, size));
      TORCH_CHECK(base != nullptr, "pack_panels: out of memory");
#ifdef MADV_HUGEPAGE
      madvise(base, size, MADV_HUGEPAGE);  // advice only: without huge pages the weights still work
#endif
      chunk = std::make_shared<Chunk>(base, size);
      current = chunk;
    }
    chunk->used += bytes;
  }
  char* data = chunk->base + chunk->used - bytes;
  // Zeroed a huge page a task: the first touch of a fresh page is what packing at start-up waits on (on a virtual
  // machine here a huge page's ran at 0.35-0.4 GB/s on one thread, 0.8-1.2 GB/s on two), not the copy after it.
  const int64_t pages = (bytes + HUGE_PAGE - 1) / HUGE_PAGE;
  parallel_pack(pages, [&](int64_t begin, int64_t end) {
    std::memset(data + begin * HUGE_PAGE, 0, std::min(bytes, end * HUGE_PAGE) - begin * HUGE_PAGE);
  });
  return torch::from_blob(data, sizes, [chunk](void*) mutable { chunk.reset(); }, torch::dtype(dtype));
}

// Output features and input width of the row blocks `ws` stacked (CPU [N_i, K] each, of `dtype`: fp32, or int8
// for `pack_panels_int8` / `pack_panels_w8a8`).
static std::pair<int64_t, int64_t> stacked_shape(const std::vector<torch::Tensor>& ws, torch::ScalarType dtype = torch::kFloat) {
  TORCH_CHECK(!ws.empty(), "pack_panels: at least one weight");
  const int64_t k = ws[0].size(1);
  int64_t n = 0;
  for (const auto& w : ws) {
    TORCH_CHECK(w.dim() == 2 && w.size(1) == k && w.scalar_type() == dtype && w.device().is_cpu(),
                "pack_panels: ", dtype == torch::kChar ? "int8 weights" : "fp32 weights (or all bf16, or all fp16)",
                " [N, K], on the CPU");
    n += w.size(0);
  }
  return {n, k};
}

// fp32, bf16 (as 16-bit words) or fp16 weights of a tensor.
template <typename T>
static T* data_of(const torch::Tensor& t) {
  if constexpr (std::is_same_v<T, uint16_t>) return reinterpret_cast<T*>(t.data_ptr<at::BFloat16>());
  else return t.data_ptr<T>();
}

// Each row of the row blocks `ws` stacked (contiguous: a block that is not is copied into `held`).
template <typename T>
static std::vector<const T*> stacked_rows(const std::vector<torch::Tensor>& ws, std::vector<torch::Tensor>& held) {
  std::vector<const T*> rows;
  for (const auto& block : ws) {
    held.push_back(block.contiguous());
    const T* wp = data_of<T>(held.back());
    for (int64_t i = 0; i < block.size(0); ++i) rows.push_back(wp + i * block.size(1));
  }
  return rows;
}

template <typename T>
static torch::Tensor pack_panels_as(const std::vector<torch::Tensor>& ws, int64_t n, int64_t k) {
  auto out = huge_page_tensor({(n + PANEL - 1) / PANEL, k, PANEL}, ws[0].scalar_type());
  T* op = data_of<T>(out);
  std::vector<torch::Tensor> held;
  const auto rows = stacked_rows<T>(ws, held);
  parallel_pack(out.size(0), [&](int64_t begin, int64_t end) {  // (a panel a task)
    for (int64_t j = begin * PANEL; j < std::min(n, end * PANEL); ++j) {  // output feature
      T* column = op + (j / PANEL) * k * PANEL + j % PANEL;
      for (int64_t c = 0; c < k; ++c) column[c * PANEL] = rows[j][c];
    }
  });
  return out;
}

// The dtype of weight blocks `pack_panels` takes as they are: fp32, or all bf16 or all fp16.
static torch::ScalarType panel_dtype(const torch::Tensor& w) {
  const auto t = w.scalar_type();
  return t == torch::kBFloat16 || t == torch::kHalf ? t : torch::kFloat;
}

// The row blocks `ws` ([N_i, K] each, all fp32, all bf16 or all fp16) stacked, so that q, k and v (or gate and
// up) projections compute as one. bf16 / fp16 blocks give panels of their type, half the bytes, which
// `panel_linear` widens to fp32 (exactly) as it loads them (fp32 rows, fp32 sums).
torch::Tensor pack_panels(std::vector<torch::Tensor> ws) {
  TORCH_CHECK(!ws.empty(), "pack_panels: at least one weight");
  const auto dtype = panel_dtype(ws[0]);
  const auto [n, k] = stacked_shape(ws, dtype);
  if (dtype == torch::kBFloat16) return pack_panels_as<uint16_t>(ws, n, k);
  if (dtype == torch::kHalf) return pack_panels_as<at::Half>(ws, n, k);
  return pack_panels_as<float>(ws, n, k);
}

// A gated MLP's gate and up projections ([I, K] each, I a multiple of 16) packed for `panel_linear(..., gated)`,
// which computes silu(x @ gate.T) * (x @ up.T) in one pass: their panels in turns (gate's first 16 features, up's
// first 16, ...), so that the kernel's pairs of panels are a gate panel and its up panel, whose outputs it
// combines in registers' reach instead of writing both out for a second pass to read back.
template <typename T>
static torch::Tensor pack_panels_gated_as(const torch::Tensor& gate, const torch::Tensor& up, int64_t n, int64_t k) {
  auto out = huge_page_tensor({n / PANEL, k, PANEL}, gate.scalar_type());
  T* op = data_of<T>(out);
  const auto g = gate.contiguous(), u = up.contiguous();
  parallel_pack(n / 2 / PANEL, [&](int64_t begin, int64_t end) {  // (a gate panel and its up panel a task)
    for (int64_t i = begin * PANEL; i < end * PANEL; ++i)
      for (int which = 0; which < 2; ++which) {
        const T* row = data_of<T>(which ? u : g) + i * k;
        T* column = op + (2 * (i / PANEL) + which) * k * PANEL + i % PANEL;
        for (int64_t c = 0; c < k; ++c) column[c * PANEL] = row[c];
      }
  });
  return out;
}

// (fp32, bf16 or fp16, as `pack_panels`)
torch::Tensor pack_panels_gated(torch::Tensor gate, torch::Tensor up) {
  const auto dtype = panel_dtype(gate);
  const auto [n, k] = stacked_shape({gate, up}, dtype);
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.size(0) % PANEL == 0, "pack_panels_gated: gate and up [I, K], I a multiple of 16");
  if (dtype == torch::kBFloat16) return pack_panels_gated_as<uint16_t>(gate, up, n, k);
  if (dtype == torch::kHalf) return pack_panels_gated_as<at::Half>(gate, up, n, k);
  return pack_panels_gated_as<float>(gate, up, n, k);
}

// Output features and input width of the int8 row blocks `qs` stacked, checked against their `scales`.
static std::pair<int64_t, int64_t> int8_stacked_shape(const std::vector<torch::Tensor>& qs, const torch::Tensor& scales) {
  const auto [n, k] = stacked_shape(qs, torch::kChar);
  TORCH_CHECK(scales.dim() == 1 && scales.numel() == n && scales.scalar_type() == torch::kFloat && scales.is_contiguous(),
              "pack_panels_int8/w8a8: one fp32 scale per output feature");
  return {n, k};
}

// int8 weights laid out as `pack_panels` lays out fp32 ones: the row blocks `qs` ([N_i, K] int8 each) stacked,
// `scales` [N] fp32 each output feature's scale (rounded in torch by `cpu_linear.int8_weights`): [ceil(N / 16),
// K * 16 + 64] bytes, each panel's K * 16 weights followed by its 16 scales. A quarter of fp32's bytes.
torch::Tensor pack_panels_int8(std::vector<torch::Tensor> qs, torch::Tensor scales) {
  const auto [n, k] = int8_stacked_shape(qs, scales);
  const int64_t width = k * PANEL + PANEL * 4;
  auto out = huge_page_tensor({(n + PANEL - 1) / PANEL, width}, torch::kChar);
  int8_t* op = out.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  std::vector<torch::Tensor> held;
  const auto rows = stacked_rows<int8_t>(qs, held);
  parallel_pack(out.size(0), [&](int64_t begin, int64_t end) {  // (a panel a task)
    for (int64_t j = begin * PANEL; j < std::min(n, end * PANEL); ++j) {  // output feature
      int8_t* panel = op + (j / PANEL) * width;
      for (int64_t c = 0; c < k; ++c) panel[c * PANEL + j % PANEL] = rows[j][c];
      std::memcpy(panel + k * PANEL + (j % PANEL) * 4, sp + j, 4);
    }
  });
  return out;
}

// 16 accumulated outputs (two vectors) into y, the bias added, the first `cols` only (the last panel's may be fewer).
static inline void store_panel(const v8* acc, float* y, int64_t cols, const float* bias) {
  if (cols == PANEL && !bias) {
    std::memcpy(y, acc, 64);
    return;
  }
  float out[PANEL];
  std::memcpy(out, acc, 64);
  for (int64_t j = 0; j < cols; ++j) y[j] = bias ? out[j] + bias[j] : out[j];
}

// rows x 16 outputs of one panel: every weight loaded once per row tile, 2 * ROWS accumulators in registers.
// W: the weights' type, float, bf16 (uint16_t) or fp16 (at::Half), widened as loaded: the same sums as over
// their fp32 values.
template <int ROWS, typename W = float>
static inline void panel_tile(const float* xp, int64_t k, const W* panel, float* yp, int64_t ldy, int64_t cols,
                              const float* bias, const W* next) {
  v8 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = v8{};
  for (int64_t c = 0; c < k; ++c) {
    const v8 w0 = load8(panel + c * PANEL);
    const v8 w1 = load8(panel + c * PANEL + 8);
    if (next) __builtin_prefetch(next + c * PANEL);
    for (int r = 0; r < ROWS; ++r) {
      const float s = xp[r * k + c];
      acc[r][0] = madd(s, w0, acc[r][0]);
      acc[r][1] = madd(s, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < ROWS; ++r) store_panel(acc[r], yp + r * ldy, cols, bias);
}

// Up to three rows through two neighbouring panels at once: twice the accumulator chains of `panel_tile`, and
// two streams for the hardware prefetcher (no software prefetch: it made this slower). Each output sums in the
// same order as in `panel_tile`. Steps of one to three rows are all such tiles. Streaming a 450 MB weight on
// this machine's two cores: at one row 17-20 GB/s against torch's plain sum at 19-22 (one panel at a time with
// the prefetch: 14.5-19.6 against 22-24); at two and three rows 19-22 and 19-21 GB/s (before: 18-19 and
// 15-19). Four rows (16 accumulators) read the same as their 6-row tile within the noise: not taken.
template <int ROWS, typename W = float>
static inline void panel_pair(const float* xp, int64_t k, const W* panel, float* yp, int64_t ldy, int64_t cols2,
                              const float* bias) {
  const W* second = panel + k * PANEL;
  v8 a[ROWS][2], b[ROWS][2];
  for (int r = 0; r < ROWS; ++r) a[r][0] = a[r][1] = b[r][0] = b[r][1] = v8{};
  for (int64_t c = 0; c < k; ++c) {
    const v8 w0 = load8(panel + c * PANEL), w1 = load8(panel + c * PANEL + 8);
    const v8 u0 = load8(second + c * PANEL), u1 = load8(second + c * PANEL + 8);
    for (int r = 0; r < ROWS; ++r) {
      const float s = xp[r * k + c];
      a[r][0] = madd(s, w0, a[r][0]);
      a[r][1] = madd(s, w1, a[r][1]);
      b[r][0] = madd(s, u0, b[r][0]);
      b[r][1] = madd(s, u1, b[r][1]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    store_panel(a[r], yp + r * ldy, PANEL, bias);
    store_panel(b[r], yp + r * ldy + PANEL, cols2, bias ? bias + PANEL : nullptr);
  }
}

// `panel_tile` for 1 to 6 rows.
template <typename W>
static inline void panel_tile_rows(int64_t rows, const float* xp, int64_t k, const W* panel, float* yp, int64_t ldy,
                                   int64_t cols, const float* bias, const W* next) {
  switch (rows) {
    case 6: panel_tile<6>(xp, k, panel, yp, ldy, cols, bias, next); break;
    case 5: panel_tile<5>(xp, k, panel, yp, ldy, cols, bias, next); break;
    case 4: panel_tile<4>(xp, k, panel, yp, ldy, cols, bias, next); break;
    case 3: panel_tile<3>(xp, k, panel, yp, ldy, cols, bias, next); break;
    case 2: panel_tile<2>(xp, k, panel, yp, ldy, cols, bias, next); break;
    default: panel_tile<1>(xp, k, panel, yp, ldy, cols, bias, next); break;
  }
}

#include "x86/avx512_panels.h"
