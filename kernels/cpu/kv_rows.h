// Part of the kernels' one translation unit: cpu_kernels.cpp includes the parts in order, each using those
// before it. This one: a KV cache's rows (fp32, bf16, int8 with a scale) as the kernels read and write them.
#pragma once


// A KV cache holds fp32, or bf16 (`EngineConfig.kv_cache_dtype`: the upper halves of fp32 values, kept as their
// bits); an element as fp32, widened exactly.
static inline float to_float(float x) { return x; }
static inline float to_float(uint16_t x) {
  const uint32_t w = (uint32_t)x << 16;
  float f;
  std::memcpy(&f, &w, sizeof f);
  return f;
}

// n fp32 values into the cache: as they are, or rounded to bf16 to nearest even, as torch rounds them (so that a
// step written here and one written by torch's `index_copy_` leave the same bits; a NaN, told by its bits, stays a
// NaN).
static inline void store_row(const float* src, int64_t n, float* dst) { std::copy(src, src + n, dst); }
static inline void store_row(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t w;
    std::memcpy(&w, src + i, sizeof w);
    dst[i] = (w & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0 : (uint16_t)((w + 0x7fffu + ((w >> 16) & 1u)) >> 16);
  }
}

// int8 K/V (`EngineConfig.kv_cache_dtype="int8"`): a row (one position of one KV head) holds `dim` codes and then
// its scale's four bytes (fp32); the row's values are code * scale. scale = max |x| * (1 / 127) and code = x *
// (127 / max |x|) rounded half to even, computed as `kernels/base.quantize_kv` computes them (the same operations
// in the same order): torch's reference rounds a row as this does. A row
// with a NaN or an infinity stores codes 0 and a NaN scale: every value it gives is NaN; a row whose largest
// magnitude is below 2^-120 (where 127 / max |x| would overflow) stores codes 0: values 0.
static inline float to_float(int8_t x) { return (float)x; }
static inline v8 load8(const int8_t* p) {
  v8 r;
  for (int i = 0; i < 8; ++i) r[i] = (float)p[i];
  return r;
}

// Elements of type T in a cache line.
template <typename T>
constexpr int64_t LINE = 64 / sizeof(T);

// Elements of a cache row of `dim` values, and the factor its stored elements take.
template <typename T>
constexpr bool QUANTIZED = std::is_same_v<T, int8_t>;
template <typename T>
static inline int64_t row_of(int64_t dim) { return QUANTIZED<T> ? dim + 4 : dim; }
template <typename T>
static inline float row_scale(const T* row, int64_t dim) {
  if constexpr (QUANTIZED<T>) {
    float s;
    std::memcpy(&s, row + dim, sizeof s);
    return s;
  } else {
    return 1.f;
  }
}

constexpr float KV8_UNIT = 1.0f / 127.0f, KV8_SMALLEST = 0x1p-120f;

static void __attribute__((noinline)) store_row(const float* src, int64_t n, int8_t* dst) {
#ifdef __AVX512F__
  if (n % 16 == 0) {  // (scalar: 6,120 rows of 64, a 34-row decode step's for SmolLM2, took 1.7-2.0 ms)
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff), infinity = _mm512_set1_epi32(0x7f800000);
    __m512 most = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (int64_t i = 0; i < n; i += 16) {
      const __m512i w = _mm512_and_si512(_mm512_loadu_si512(src + i), magnitude);
      bad |= _mm512_cmpge_epu32_mask(w, infinity);
      most = _mm512_max_ps(most, _mm512_castsi512_ps(w));
    }
    const float top = _mm512_reduce_max_ps(most);
    const float scale = bad ? std::numeric_limits<float>::quiet_NaN() : top * KV8_UNIT;
    const __m512 inv = _mm512_set1_ps(!bad && top >= KV8_SMALLEST ? 127.f / top : 0.f);
    for (int64_t i = 0; i < n; i += 16) {  // rounded half to even (the default rounding mode), then narrowed
      const __m512i code = bad ? _mm512_setzero_si512() : _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(src + i), inv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm512_cvtsepi32_epi8(code));
    }
    std::memcpy(dst + n, &scale, sizeof scale);
    return;
  }
#endif
  float top = 0.f;
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t w;
    std::memcpy(&w, src + i, sizeof w);
    finite = finite && (w & 0x7fffffffu) < 0x7f800000u;
    const float a = __builtin_fabsf(src[i]);
    top = a > top ? a : top;
  }
  const float scale = finite ? top * KV8_UNIT : std::numeric_limits<float>::quiet_NaN();
  const float inv = finite && top >= KV8_SMALLEST ? 127.f / top : 0.f;
  for (int64_t i = 0; i < n; ++i) dst[i] = (int8_t)__builtin_nearbyintf(finite ? src[i] * inv : 0.f);
  std::memcpy(dst + n, &scale, sizeof scale);
}

// fn(keys, values) over a layer's cache as its elements are stored: fp32, bf16 (as their bits) or int8 rows.
template <typename F>
static void with_cache(const torch::Tensor& k, const torch::Tensor& v, const F& fn) {
  const auto t = k.scalar_type();
  TORCH_CHECK(v.scalar_type() == t && (t == torch::kFloat || t == torch::kBFloat16 || t == torch::kChar),
              "the KV cache: fp32, bf16 or int8, keys and values alike");
  if (t == torch::kFloat) fn(k.data_ptr<float>(), v.data_ptr<float>());
  else if (t == torch::kChar) fn(k.data_ptr<int8_t>(), v.data_ptr<int8_t>());
  else fn(reinterpret_cast<uint16_t*>(k.data_ptr<at::BFloat16>()), reinterpret_cast<uint16_t*>(v.data_ptr<at::BFloat16>()));
}

// Rows of x ([N, D] fp32) as an int8 cache stores them ([N, D + 4]).
torch::Tensor quantize_kv(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "quantize_kv: contiguous fp32 [N, D]");
  const int64_t n = x.size(0), d = x.size(1);
  auto out = torch::empty({n, d + 4}, torch::kChar);
  for (int64_t r = 0; r < n; ++r) store_row(x.data_ptr<float>() + r * d, d, out.data_ptr<int8_t>() + r * (d + 4));
  return out;
}
