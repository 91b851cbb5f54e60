// Part of the kernels' one translation unit: cpu_kernels.cpp includes the parts in order, each using those
// before it. This one: vector types, loads and the arithmetic every kernel shares.
#pragma once

typedef float v4 __attribute__((vector_size(16)));

// A vector V of fp32 values from fp32 memory.
template <typename V>
static inline V load_floats(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// A vector V of fp32 values from bf16 weights (`pack_panels` over bfloat16 blocks): the upper halves of fp32
// ones, widened exactly by a shift (H, U: V's lanes as 16- and 32-bit words).
template <typename V, typename H, typename U>
static inline V load_bf16(const uint16_t* p) {
  H h;
  std::memcpy(&h, p, sizeof h);
  const U w = __builtin_convertvector(h, U) << 16;
  V v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

typedef uint16_t h8 __attribute__((vector_size(16)));
typedef uint32_t u8 __attribute__((vector_size(32)));

static inline v8 load8(const float* p) { return load_floats<v8>(p); }
static inline v8 load8(const uint16_t* p) { return load_bf16<v8, h8, u8>(p); }

// fp16 weights (`pack_panels` over float16 blocks), widened exactly (F16C where the CPU has it).
static inline v8 load8(const at::Half* p) {
#ifdef __F16C__
  return (v8)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  v8 v;
  for (int i = 0; i < 8; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

// a * b + c. The file is built with -ffp-contract=off: a multiply and an add written apart are never fused, and
// these always are (one rounding) where the CPU has FMA. Which multiply-adds fuse is then the source's choice, not
// the compiler's, so two paths that run the same source on the same values (a bf16 cache widened, an fp32 cache of
// the same values; tiles of 5 rows or of 12) give the same bits at every level and tuning.
static inline float madd(float a, float b, float c) {
#ifdef __FMA__
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}
static inline v8 madd(v8 a, v8 b, v8 c) {
#ifdef __FMA__
  return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}
static inline v8 madd(float a, v8 b, v8 c) { return madd(v8{a, a, a, a, a, a, a, a}, b, c); }
template <typename T>
T madd(T, T, T) = delete;  // (no integer multiply-add by way of float)

static inline float hsum(v8 v) {
#if defined(__clang__) || __GNUC__ >= 12  // __builtin_shufflevector: halves added as vectors
  const v4 x = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  const v4 y = x + __builtin_shufflevector(x, x, 2, 3, 0, 1);
  return y[0] + y[1];
#else
  return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
#endif
}

typedef int32_t vi8 __attribute__((vector_size(32)));

// exp of each lane (the softmax's, the gated activations'): Cephes' expf, within 2 ulp of exp, written out so that
// it vectorises at every level without libm's vector functions (which glibc offers only under fast-math) and
// gives the same bits wherever one build runs it. Past 88 it gives +inf (exp(88) is 1.7e38); below -87.3, 0 (exp's
// values there are below 1.2e-38, nothing next to the sums they join); a NaN stays a NaN. V: 8 or 16 floats, I: as
// many int32.
template <typename V, typename I>
static inline V vexp(V x) {
  const V hi = V{} + 88.f, lo = V{} - 87.33654f, big = V{} + 12582912.f;  // big: 1.5 x 2^23, rounds to an integer
  V c = x > hi ? hi : x;
  c = c < lo ? lo : c;
  const V n = (c * 1.44269504088896341f + big) - big;  // round(x / ln 2)
  const V r = (c - n * 0.693359375f) - n * -2.12194440e-4f;  // x - n ln 2, ln 2 in two parts
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;  // 2^n
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  V y = p * scale;
  y = x < lo ? V{} : y;
  return x > hi ? V{} + __builtin_inff() : y;
}

// The widest vector of floats the level has, for the loops through exp: 16 lanes with AVX-512, else 8.
#ifdef __AVX512F__
typedef float vw __attribute__((vector_size(64)));
typedef int32_t vwi __attribute__((vector_size(64)));
static inline float hsum(vw v) {
  v8 lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const float*>(&v) + 8, sizeof hi);
  return hsum(lo + hi);
}
#else
typedef v8 vw;
typedef vi8 vwi;
#endif
constexpr int64_t WIDE = sizeof(vw) / sizeof(float);

static inline vw expw(vw x) { return vexp<vw, vwi>(x); }
static inline float exp1(float x) { return expw(vw{} + x)[0]; }  // the lanes' arithmetic, for one value
static inline vw loadw(const float* p) { return load_floats<vw>(p); }
static inline void storew(float* p, vw v) { std::memcpy(p, &v, sizeof v); }

// The first k (< WIDE) floats at p as a vector, the rest `pad`; and the first k lanes of v stored at p.
static inline vw loadw_part(const float* p, int64_t k, float pad) {
  vw v = vw{} + pad;
  std::memcpy(&v, p, k * sizeof(float));
  return v;
}
static inline void storew_part(float* p, vw v, int64_t k) { std::memcpy(p, &v, k * sizeof(float)); }
