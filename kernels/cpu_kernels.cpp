#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <condition_variable>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <thread>
#include <type_traits>
#include <sys/mman.h>
#include <unistd.h>
#include <utility>
#include <vector>
#if defined(__AVX2__) || defined(__FMA__)
#include <immintrin.h>
#endif

// A thread pool of our own for the kernels of calls on one or two rows (batch-1 and -2 decode steps). libgomp
// (torch's OpenMP) gives every thread that opens parallel regions a team of its own, and once the process
// holds more OpenMP threads than CPUs (the engine's forward thread's team plus the one any parallel torch op on
// the main thread leaves behind) idle team threads sleep at once instead of spinning: every short parallel
// region then waits for a wake-up, and a batch-1 step of SmolLM2 took ~34 instead of ~23 ms. These workers
// spin for a short while after each task before they sleep. Larger calls stay on OpenMP, like the torch ops
// around them: two sets of spinning threads on the same cores slow each other (a 64-row step ran ~15% slower
// with oneDNN on OpenMP and every kernel here on this pool; a 64-row one-call decode step 266 vs 190 ms with
// its kernels on the pool instead of OpenMP).
static inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

class Pool {
 public:
  explicit Pool(int size) : size_(size) {
    for (int i = 1; i < size; ++i) std::thread([this, i] { work(i); }).detach();  // live as long as the process
  }
  int size() const { return size_; }
  // fn(i) for every i in [0, parts), parts <= size(); the calling thread runs part 0.
  void run(int parts, const std::function<void(int)>& fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = &fn;
      parts_ = parts;
      pending_.store(parts - 1, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    fn(0);
    while (pending_.load(std::memory_order_acquire) > 0) cpu_relax();
  }

 private:
  void work(int i) {
    long seen = 0;
    for (;;) {
      const auto idle_since = std::chrono::steady_clock::now();
      for (unsigned spins = 1; generation_.load(std::memory_order_acquire) == seen; ++spins) {
        if (spins % 256 == 0 && std::chrono::steady_clock::now() - idle_since > std::chrono::microseconds(200)) {
          std::unique_lock<std::mutex> lock(mu_);
          wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
          break;
        }
        cpu_relax();
      }
      seen = generation_.load(std::memory_order_acquire);
      if (i < parts_) {
        (*fn_)(i);
        pending_.fetch_sub(1, std::memory_order_release);
      }
    }
  }
  const int size_;
  std::mutex mu_;
  std::condition_variable wake_;
  std::atomic<long> generation_{0};
  std::atomic<int> pending_{0};
  const std::function<void(int)>* fn_ = nullptr;
  int parts_ = 0;
};

static std::mutex pool_busy;  // one caller at a time; another one meanwhile runs its work alone

// One for every kernel, sized by torch's thread count when first used; a forked child (which has no workers)
// makes its own. Called with `pool_busy` held.
static Pool* the_pool() {
  static Pool* pool = nullptr;
  static pid_t owner = 0;
  if (pool == nullptr || owner != getpid()) {
    pool = new Pool(std::max(1, at::get_num_threads()));
    owner = getpid();
  }
  return pool;
}

// fn(begin, end) over [0, n) split in parts of at least `grain` each: on the pool above for a call on one or
// two rows (`small`), else on torch's threads (at::parallel_for).
template <typename F>
static void parallel(int64_t n, int64_t grain, bool small, const F& fn) {
  if (!small) {
    at::parallel_for(0, n, grain, fn);
    return;
  }
  std::unique_lock<std::mutex> lock(pool_busy, std::try_to_lock);
  Pool* pool = lock.owns_lock() ? the_pool() : nullptr;
  const int64_t parts = pool ? std::min<int64_t>(pool->size(), (n + grain - 1) / std::max<int64_t>(grain, 1)) : 1;
  if (parts <= 1) {
    if (n > 0) fn(0, n);
    return;
  }
  pool->run((int)parts, [&](int p) { fn(n * p / parts, n * (p + 1) / parts); });
}

typedef float v8 __attribute__((vector_size(32)));
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
  const uint16_t* vn = nullptr;  // set instead of `p` for bf16 compute (`vnni_panels` weights, cpu_bf16.h)
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
  std::memset(data, 0, bytes);
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

template <typename T>
static torch::Tensor pack_panels_as(const std::vector<torch::Tensor>& ws, int64_t n, int64_t k) {
  auto out = huge_page_tensor({(n + PANEL - 1) / PANEL, k, PANEL}, ws[0].scalar_type());
  T* op = data_of<T>(out);
  int64_t j = 0;  // output feature
  for (const auto& block : ws) {
    const auto w = block.contiguous();
    const T* wp = data_of<T>(w);
    for (int64_t i = 0; i < w.size(0); ++i, ++j) {
      T* column = op + (j / PANEL) * k * PANEL + j % PANEL;
      for (int64_t c = 0; c < k; ++c) column[c * PANEL] = wp[i * k + c];
    }
  }
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
  for (int64_t i = 0; i < n / 2; ++i)
    for (int which = 0; which < 2; ++which) {
      const T* row = data_of<T>(which ? u : g) + i * k;
      T* column = op + (2 * (i / PANEL) + which) * k * PANEL + i % PANEL;
      for (int64_t c = 0; c < k; ++c) column[c * PANEL] = row[c];
    }
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
  int64_t j = 0;  // output feature
  for (const auto& block : qs) {
    const auto q = block.contiguous();
    const int8_t* qp = q.data_ptr<int8_t>();
    for (int64_t i = 0; i < q.size(0); ++i, ++j) {
      int8_t* panel = op + (j / PANEL) * width;
      for (int64_t c = 0; c < k; ++c) panel[c * PANEL + j % PANEL] = qp[i * k + c];
      std::memcpy(panel + k * PANEL + (j % PANEL) * 4, sp + j, 4);
    }
  }
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
  int64_t j = 0;
  for (const auto& block : qs) {
    const auto q = block.contiguous();
    const int8_t* qp = q.data_ptr<int8_t>();
    for (int64_t i = 0; i < q.size(0); ++i, ++j) {
      uint8_t* panel = op + (j / PANEL) * width;
      const int64_t f = j % PANEL;
      int32_t* sums = reinterpret_cast<int32_t*>(panel + k * PANEL);
      for (int64_t c = 0; c < k; ++c) {
        panel[((c / 4) * PANEL + f) * 4 + c % 4] = static_cast<uint8_t>(qp[i * k + c]);
        sums[(c / A8_BLOCK) * PANEL + f] -= 128 * qp[i * k + c];
      }
      std::memcpy(panel + k * PANEL + blocks * PANEL * 4 + f * 4, sp + j, 4);
    }
  }
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
#include "cpu_bf16.h"

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

// Attention of prefill chunks over the paged, head-major cache ([kv_heads, slots, dim]), causal (and within
// `window`, 0: none), each chunk's own keys and values already written. Chunk j is query rows [starts[j],
// starts[j] + qlens[j]) of q (`rows_in` rows `q_stride` floats apart, each starting with its heads x dim
// queries), positions ctx[j] - qlens[j] .. ctx[j] - 1, its block table row j of `tables`; out [rows, heads,
// dim]. First each chunk's keys are copied into panels (16 positions at a time, transposed) and its values
// into panels of 16 dims; then one task per (chunk, KV head, tile of 8 query rows) takes the
// tile's rows times `group` query heads against 64 keys at a time, both products `panel_tile`s (with 512-bit
// vectors and whole panels, `panel_tile16`s over two of them: a 256-token chunk of SmolLM2's on an AMD EPYC, three
// alternating processes, 744-1044 -> 639-741 us), with an online softmax. Keys past a row's position (or before
// its window) weigh nothing; groups of 16 wholly outside are never read. `softcap` and `sinks` as in
// `decode_attention`.
template <typename T>
static void prefill_attention(const float* qp, int64_t q_stride, int64_t rows_in, int64_t heads, int64_t dim,
                              const T* kp, const T* vp, int64_t kv_heads, int64_t slots, const int64_t* tp,
                              int64_t width, const int64_t* cp, const int64_t* lp, const int64_t* sp, int64_t chunks,
                              float* op, double scale, int64_t window, int64_t block_size, float softcap = 0.f,
                              const float* sinks = nullptr) {
  constexpr int64_t ROWS = 8, KEYS = PANEL, SPAN = 4 * KEYS;
  const int64_t group = heads / kv_heads, dim_panels = (dim + PANEL - 1) / PANEL, rs = row_of<T>(dim);
  const int64_t panel_floats = dim_panels * PANEL * KEYS;  // one group of 16 keys (or of their values)
  // per chunk and KV head: its key groups' panels, [groups][dim][16], then its values, [dim / 16][keys][16]
  // each chunk's groups of 16 key positions [first_group, ctx / 16], and where its panels start
  std::vector<int64_t> first_group(chunks), groups(chunks), base(chunks + 1, 0);
  std::vector<std::array<int64_t, 3>> copies, tasks;  // (chunk, KV head, group) and (chunk, KV head, first row)
  for (int64_t j = 0; j < chunks; ++j) {
    TORCH_CHECK(lp[j] <= cp[j] && -(-cp[j] / block_size) <= width && sp[j] + lp[j] <= rows_in,
                "paged_prefill: chunk beyond its table or the queries");
    const int64_t lowest = window > 0 ? std::max<int64_t>(0, cp[j] - lp[j] - window + 1) : 0;
    first_group[j] = lowest / KEYS;
    groups[j] = (cp[j] - 1) / KEYS + 1 - first_group[j];
    base[j + 1] = base[j] + kv_heads * groups[j] * 2 * panel_floats;
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t g = 0; g < groups[j]; ++g) copies.push_back({j, h, g});
      for (int64_t i = 0; i < lp[j]; i += ROWS) tasks.push_back({j, h, i});
    }
  }
  // Kept from call to call on each thread, up to 64 MiB: a fresh allocation of this size is fresh pages, which the
  // kernel zeroes as they are first written (a one-row chunk at 4,096 positions of SmolLM2's, one layer: 750 ->
  // 480 us with the transposing copy below).
  constexpr int64_t KEEP = 16 << 20;
  thread_local torch::Tensor kept;
  torch::Tensor panels = kept;
  if (!panels.defined() || panels.numel() < base[chunks]) {
    panels = torch::empty({base[chunks]}, torch::kFloat);  // torch's allocation: aligned for panel_tile
    if (base[chunks] <= KEEP) kept = panels;
  }
  float* pp = panels.data_ptr<float>();
  auto keys_of = [&](int64_t j, int64_t h) { return pp + base[j] + h * groups[j] * 2 * panel_floats; };
  auto values_of = [&](int64_t j, int64_t h) { return keys_of(j, h) + groups[j] * panel_floats; };
  parallel((int64_t)copies.size(), 16, false, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t j = copies[t][0], h = copies[t][1], g = copies[t][2];
      float* kt = keys_of(j, h) + g * panel_floats;
      float* vt = values_of(j, h) + g * KEYS * PANEL;  // this group's 16 keys in each panel of 16 dims
      const int64_t panel_stride = groups[j] * KEYS * PANEL;
#ifdef __AVX512F__
      // 16 keys by 16 dims at a time, transposed in registers, missing keys zeros (element by element, a one-row
      // chunk at 1,024 positions took 145 us a layer of SmolLM2's, 75-87 so)
      if (dim % PANEL == 0) {
        const T* krow[KEYS];
        const T* vrow[KEYS];
        int64_t count = 0;
        for (; count < KEYS; ++count) {
          const int64_t pos = (first_group[j] + g) * KEYS + count;
          if (pos >= cp[j]) break;
          const int64_t slot = tp[j * width + pos / block_size] * block_size + pos % block_size;
          krow[count] = kp + (h * slots + slot) * rs;
          vrow[count] = vp + (h * slots + slot) * rs;
        }
        __m512 ks[KEYS], vs[KEYS];  // each int8 row's scale
        if constexpr (QUANTIZED<T>)
          for (int64_t c = 0; c < count; ++c) {
            ks[c] = _mm512_set1_ps(row_scale(krow[c], dim));
            vs[c] = _mm512_set1_ps(row_scale(vrow[c], dim));
          }
        for (int64_t p = 0; p < dim_panels; ++p) {
          __m512 r[KEYS];
          for (int64_t c = 0; c < KEYS; ++c) {
            if (c < count) {
              r[c] = load512(krow[c] + p * PANEL);
              __m512 v = load512(vrow[c] + p * PANEL);
              if constexpr (QUANTIZED<T>) {
                r[c] = _mm512_mul_ps(r[c], ks[c]);
                v = _mm512_mul_ps(v, vs[c]);
              }
              _mm512_storeu_ps(vt + p * panel_stride + c * PANEL, v);
            } else {
              r[c] = _mm512_setzero_ps();
              _mm512_storeu_ps(vt + p * panel_stride + c * PANEL, r[c]);
            }
          }
          transpose16(r);
          for (int64_t d = 0; d < PANEL; ++d) _mm512_storeu_ps(kt + (p * PANEL + d) * KEYS, r[d]);
        }
        continue;
      }
#endif
      std::fill(kt, kt + panel_floats, 0.f);
      for (int64_t p = 0; p < dim_panels; ++p) std::fill(vt + p * panel_stride, vt + p * panel_stride + KEYS * PANEL, 0.f);
      for (int64_t c = 0; c < KEYS; ++c) {
        const int64_t pos = (first_group[j] + g) * KEYS + c;
        if (pos >= cp[j]) break;
        const int64_t slot = tp[j * width + pos / block_size] * block_size + pos % block_size;
        const T* kr = kp + (h * slots + slot) * rs;
        const T* vr = vp + (h * slots + slot) * rs;
        const float ks = row_scale(kr, dim), vs = row_scale(vr, dim);
        for (int64_t d = 0; d < dim; ++d) {
          kt[d * KEYS + c] = to_float(kr[d]) * ks;
          vt[(d / PANEL) * panel_stride + c * PANEL + d % PANEL] = to_float(vr[d]) * vs;
        }
      }
    }
  });
  const float fscale = (float)scale;
  parallel((int64_t)tasks.size(), 1, false, [&](int64_t begin, int64_t end) {
    const int64_t nq_max = ROWS * group;
    std::vector<float> qs(nq_max * dim), acc(nq_max * dim), part(nq_max * dim), scores(nq_max * SPAN), mx(nq_max),
        total(nq_max), rescale(nq_max);
    std::vector<int64_t> lo(nq_max), hi(nq_max);  // each query's key positions [lo, hi]
    for (int64_t t = begin; t < end; ++t) {
      const int64_t j = tasks[t][0], h = tasks[t][1], i0 = tasks[t][2];
      const int64_t rows = std::min(ROWS, lp[j] - i0), nq = rows * group, first_pos = cp[j] - lp[j] + i0;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < group; ++g) {
          const int64_t i = r * group + g;
          const float* src = qp + (sp[j] + i0 + r) * q_stride + (h * group + g) * dim;
          for (int64_t d = 0; d < dim; ++d) qs[i * dim + d] = src[d] * fscale;
          hi[i] = first_pos + r;
          lo[i] = window > 0 ? std::max<int64_t>(0, hi[i] - window + 1) : 0;
          // a sink starts the online softmax as one more key, of weight exp(0) at its own logit and no value
          total[i] = sinks ? 1.f : 0.f;
          if (sinks) mx[i] = sinks[h * group + g];
        }
      std::fill(acc.begin(), acc.begin() + nq * dim, 0.f);
      const float* kh = keys_of(j, h);
      const float* vh = values_of(j, h);
      const int64_t first_key = first_group[j] * KEYS, panel_stride = groups[j] * KEYS * PANEL;
      for (int64_t a = lo[0] / KEYS * KEYS; a <= hi[nq - 1]; a += SPAN) {
        const int64_t span = std::min(SPAN, (hi[nq - 1] / KEYS + 1) * KEYS - a);  // keys in this span, a multiple of 16
        int64_t c = 0;
#ifdef __AVX512F__
        if (dim % PANEL == 0)  // two groups of keys at a time (their panels lie one after the other)
          for (; c + 2 * KEYS <= span; c += 2 * KEYS) {
            const float* kt = kh + (a + c - first_key) / KEYS * panel_floats;
            for (int64_t i = 0; i < nq; i += 12)
              panel_tile16_rows<12, float>(std::min<int64_t>(12, nq - i), qs.data() + i * dim, dim, kt, kt + panel_floats,
                                    scores.data() + i * span + c, span, KEYS, nullptr, nullptr);
          }
#endif
        for (; c < span; c += KEYS) {
          const float* kt = kh + (a + c - first_key) / KEYS * panel_floats;
          for (int64_t i = 0; i < nq; i += 6)
            panel_tile_rows<float>(std::min<int64_t>(6, nq - i), qs.data() + i * dim, dim, kt, scores.data() + i * span + c,
                            span, KEYS, nullptr, nullptr);
        }
        for (int64_t i = 0; i < nq; ++i) {  // scores -> weights (0 outside the query's keys [c0, c1))
          const int64_t c0 = std::max<int64_t>(0, lo[i] - a), c1 = std::min(span, hi[i] - a + 1);
          float* s = scores.data() + i * span;
          rescale[i] = 1.f;
          if (c0 >= c1) {
            std::fill(s, s + span, 0.f);
            continue;
          }
          if (softcap > 0.f) soft_cap(s + c0, c1 - c0, softcap);
          float m = *std::max_element(s + c0, s + c1);
          if (total[i] > 0.f) {
            if (mx[i] >= m) m = mx[i];
            else rescale[i] = exp1(mx[i] - m);  // a larger score: what was summed so far scales down
          }
          mx[i] = m;
          for (int64_t c = 0; c < span; c += WIDE) storew(s + c, expw(loadw(s + c) - m));  // (span: a multiple of 16)
          std::fill(s, s + c0, 0.f);
          std::fill(s + c1, s + span, 0.f);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t c = 0; c < span; ++c) sum += s[c];
          total[i] = total[i] * rescale[i] + sum;
        }
        int64_t p = 0;
#ifdef __AVX512F__
        for (; p + 2 <= dim / PANEL; p += 2) {  // two whole panels of 16 dims at a time
          const float* vt = vh + p * panel_stride + (a - first_key) * PANEL;
          for (int64_t i = 0; i < nq; i += 12)
            panel_tile16_rows<12, float>(std::min<int64_t>(12, nq - i), scores.data() + i * span, span, vt, vt + panel_stride,
                                  part.data() + i * dim + p * PANEL, dim, PANEL, nullptr, nullptr);
        }
#endif
        for (; p < dim_panels; ++p)
          for (int64_t i = 0; i < nq; i += 6)
            panel_tile_rows<float>(std::min<int64_t>(6, nq - i), scores.data() + i * span, span,
                            vh + p * panel_stride + (a - first_key) * PANEL, part.data() + i * dim + p * PANEL, dim,
                            std::min(PANEL, dim - p * PANEL), nullptr, nullptr);
        for (int64_t i = 0; i < nq; ++i) {
          float* ai = acc.data() + i * dim;
          const float* pi = part.data() + i * dim;
          const float f = rescale[i];
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) ai[d] = ai[d] * f + pi[d];
        }
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < group; ++g) {
          const int64_t i = r * group + g;
          float* o = op + ((sp[j] + i0 + r) * heads + h * group + g) * dim;
          const float inv = 1.f / total[i];
          for (int64_t d = 0; d < dim; ++d) o[d] = acc[i * dim + d] * inv;
        }
    }
  });
}

void paged_prefill(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor tables, torch::Tensor ctx,
                   torch::Tensor qlens, torch::Tensor starts, torch::Tensor out, double scale, int64_t window,
                   int64_t block_size, double softcap, c10::optional<torch::Tensor> sinks) {
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && tables.is_contiguous() && out.is_contiguous() &&
              q.scalar_type() == torch::kFloat, "paged_prefill: contiguous fp32 queries and head-major cache");
  TORCH_CHECK(tables.scalar_type() == torch::kLong && ctx.scalar_type() == torch::kLong && qlens.scalar_type() == torch::kLong &&
              starts.scalar_type() == torch::kLong && ctx.is_contiguous() && qlens.is_contiguous() && starts.is_contiguous(),
              "paged_prefill: int64 tables, lengths and starts");
  const int64_t heads = q.size(1), dim = q.size(2), kv_heads = k.size(0);
  TORCH_CHECK(heads % kv_heads == 0 && out.sizes() == q.sizes(), "paged_prefill: shapes");
  with_cache(k, v, [&](const auto* kp, const auto* vp) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(kp)>>;
    TORCH_CHECK(k.size(2) == row_of<T>(dim) && v.sizes() == k.sizes(), "paged_prefill: cache rows of the queries' dim");
    prefill_attention(q.data_ptr<float>(), heads * dim, q.size(0), heads, dim, kp, vp, kv_heads, k.size(1),
                      tables.data_ptr<int64_t>(), tables.size(1), ctx.data_ptr<int64_t>(), qlens.data_ptr<int64_t>(),
                      starts.data_ptr<int64_t>(), tables.size(0), out.data_ptr<float>(), scale, window, block_size,
                      (float)softcap, sinks_of(sinks, q));
  });
}

// Rows per parallel task for elementwise kernels: enough work per task that small steps stay on one thread.
static int64_t row_grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

// RMSNorm of t rows of width c: out = w * s / sqrt(mean(s^2) + eps), s = x (+ residual, then also written to sum).
static void rms_rows(const float* xp, const float* rp, const float* wp, double eps, int64_t t, int64_t c, float* op,
                     float* sp, bool small) {
  parallel(t, row_grain(c), small, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * c;
      float ss = 0.f;
      if (rp) {
        float* sr = sp + r * c;
        const float* rr = rp + r * c;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < c; ++i) {
          sr[i] = xr[i] + rr[i];
          ss += sr[i] * sr[i];
        }
        xr = sr;
      } else {
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < c; ++i) ss += xr[i] * xr[i];
      }
      const float inv = 1.f / std::sqrt(ss / (float)c + (float)eps);
      float* o = op + r * c;
#pragma omp simd
      for (int64_t i = 0; i < c; ++i) o[i] = wp[i] * (xr[i] * inv);
    }
  });
}

// RMSNorm of each row of x ([T, C]). With `residual`, the row normalised is x + residual, which is returned too
// (the decoder layer's residual stream); without, the second result is x.
std::vector<torch::Tensor> rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor w, double eps) {
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat,
              "rms_norm: contiguous fp32 inputs");
  auto out = torch::empty_like(x);
  torch::Tensor sum = x;
  const float* rp = nullptr;
  if (residual.has_value()) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes(), "rms_norm: residual shaped as x");
    sum = torch::empty_like(x);
    rp = residual->data_ptr<float>();
  }
  rms_rows(x.data_ptr<float>(), rp, w.data_ptr<float>(), eps, x.size(0), x.size(1), out.data_ptr<float>(),
           sum.data_ptr<float>(), false);
  return {out, sum};
}

// Rotary embedding in place on the first `heads` heads (of d each) of t rows, `stride` floats apart: the first
// and second halves of each head turn by the row's angles (cos/sin [t, d], halves repeated).
static void rotary_rows(float* xp, int64_t t, int64_t stride, const float* cp, const float* sp, int64_t d, int64_t heads,
                        bool small) {
  const int64_t half = d / 2;
  parallel(t, row_grain(heads * d), small, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cp + r * d;
      const float* s = sp + r * d;
      for (int64_t h = 0; h < heads; ++h) {
        float* a = xp + r * stride + h * d;
        float* b = a + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = a[i], x2 = b[i];
          a[i] = x1 * c[i] - x2 * s[i];
          b[i] = x2 * c[half + i] + x1 * s[half + i];
        }
      }
    }
  });
}

// RMSNorm of the queries and keys, in place, before the rotary embedding: of each of the m rows of y (`stride`
// floats apart), the first q_width floats (the queries) in parts of dq with weight `qw`, the next k_width (the
// keys) in parts of dk with `kw`; `rms_rows`'s arithmetic over each part. Parts of a head (Qwen3's and Gemma3's
// q_norm and k_norm) or of all heads at once (OLMo2's).
static void head_norm_rows(float* y, int64_t m, int64_t stride, int64_t q_width, int64_t dq, const float* qw, int64_t k_width,
                           int64_t dk, const float* kw, double eps, bool small) {
  parallel(m, 1, small, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t start = 0; start < q_width + k_width;) {
        const bool query = start < q_width;
        const int64_t d = query ? dq : dk;
        const float* w = query ? qw : kw;
        float* x = y + r * stride + start;
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t j = 0; j < d; ++j) ss += x[j] * x[j];
        const float inv = 1.f / std::sqrt(ss / (float)d + (float)eps);
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) x[j] = w[j] * (x[j] * inv);
        start += d;
      }
  });
}

// `head_norm_rows` on x ([T, >= q_width + k_width], rows contiguous), in place: the queries in parts of
// qw.numel(), the keys in parts of kw.numel() (each width a whole number of parts).
void head_norm_(torch::Tensor x, int64_t q_width, int64_t k_width, torch::Tensor qw, torch::Tensor kw, double eps) {
  const int64_t dq = qw.numel(), dk = kw.numel();
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == torch::kFloat && qw.is_contiguous() &&
              kw.is_contiguous() && qw.scalar_type() == torch::kFloat && kw.scalar_type() == torch::kFloat && dq > 0 &&
              dk > 0 && q_width % dq == 0 && k_width % dk == 0 && q_width + k_width <= x.size(1),
              "head_norm_: fp32 rows, query and key widths whole parts of their weights");
  head_norm_rows(x.data_ptr<float>(), x.size(0), x.stride(0), q_width, dq, qw.data_ptr<float>(), k_width, dk,
                 kw.data_ptr<float>(), eps, false);
}

// Rotary position embedding, in place, on the first `heads` heads of each row of x ([T, >= heads * D]).
void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads) {
  TORCH_CHECK(x.stride(1) == 1 && cos.is_contiguous() && sin.is_contiguous() && x.scalar_type() == torch::kFloat &&
              cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat, "rotary_: fp32 rows, contiguous angles");
  const int64_t t = x.size(0), d = cos.size(-1);
  TORCH_CHECK(cos.numel() == t * d && sin.numel() == t * d && heads * d <= x.size(1),
              "rotary_: one angle row per token, heads * head_dim columns");
  rotary_rows(x.data_ptr<float>(), t, x.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(), d, heads, false);
}

// The gated MLP's activation on t rows: [2n] (gate then up) -> [n], act(gate) * up (`Activation`).
static void gated_rows(const float* gp, int64_t t, int64_t n, float* op, bool small, int64_t act) {
  parallel(t, row_grain(n), small, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) gate_times_up(gp + r * 2 * n, gp + r * 2 * n + n, n, op + r * n, act);
  });
}

torch::Tensor gated_act(torch::Tensor gu, int64_t act) {
  TORCH_CHECK(gu.is_contiguous() && gu.scalar_type() == torch::kFloat && gu.size(1) % 2 == 0, "gated_act: contiguous fp32 [T, 2I]");
  TORCH_CHECK(act == SILU || act == GELU_TANH, "gated_act: activation 0 (SiLU) or 1 (GeLU, tanh)");
  const int64_t t = gu.size(0), n = gu.size(1) / 2;
  auto out = torch::empty({t, n}, gu.options());
  gated_rows(gu.data_ptr<float>(), t, n, out.data_ptr<float>(), false, act);
  return out;
}

// torch.argmax of one row: the first index of the largest value, the first NaN if there is one.
static inline bool is_nan(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return (bits & 0x7fffffffu) > 0x7f800000u;
}

static int64_t argmax_scalar(const float* row, int64_t begin, int64_t n, int64_t best) {
  for (int64_t i = begin; i < n; ++i) {
    if (is_nan(row[i])) return i;
    if (row[i] > row[best]) best = i;
  }
  return best;
}

// Eight lanes each keep their largest value and its first index; the lanes' winner is the largest value at
// the smallest index; a NaN anywhere sends the row to the scalar loop (which finds the first). A row of 49,152
// floats (SmolLM2's vocabulary): ~11.5 us, against ~224 one by one.
static int64_t argmax_row(const float* row, int64_t n) {
  if (n < 16) return argmax_scalar(row, 0, n, 0);
  v8 top = load8(row);
  i8 at = {0, 1, 2, 3, 4, 5, 6, 7}, cur = at, nan{};
  const i8 abs_mask = i8{} + 0x7fffffff, inf = i8{} + 0x7f800000;
  i8 bits;
  std::memcpy(&bits, &top, 32);
  nan |= (bits & abs_mask) > inf;
  int64_t i = 8;
  for (; i + 8 <= n; i += 8) {
    const v8 v = load8(row + i);
    cur += 8;
    std::memcpy(&bits, &v, 32);
    nan |= (bits & abs_mask) > inf;
    const i8 more = v > top;
    top = more ? v : top;
    at = more ? cur : at;
  }
  for (int l = 0; l < 8; ++l)
    if (nan[l]) return argmax_scalar(row, 0, n, 0);
  int64_t best = at[0];
  for (int l = 1; l < 8; ++l)
    if (top[l] > row[best] || (top[l] == row[best] && at[l] < best)) best = at[l];
  return argmax_scalar(row, i, n, best);
}

// The index of each row's largest value ([M, N] fp32 -> M ints), like torch.argmax (`argmax_row`); one thread
// per row, on the pool for one or two rows. torch's own argmax of a large row is an OpenMP-parallel reduction,
// and its team's threads then spin on the second core while the pool's worker needs it: the next batch-1
// step's layers ran ~3 ms slower after it.
std::vector<int64_t> argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == torch::kFloat, "argmax_rows: fp32 rows");
  const int64_t m = x.size(0), n = x.size(1), stride = x.stride(0);
  const float* xp = x.data_ptr<float>();
  std::vector<int64_t> out(m, 0);
  parallel(m, 1, m <= 2, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = argmax_row(xp + r * stride, n);
  });
  return out;
}

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

// A decode step of a fused model in one call: every decoder layer, the final norm and the LM head, with the
// same kernels in the same order as `kernels/cpu_layers.py`'s fused layer forward and the CPU attention
// backend, so the same numbers, without the Python between them (~4 ms of a ~23 ms batch-1 step of SmolLM2,
// ~0.15 ms a layer at any batch).
class FusedDecoder {
 public:
  // Per layer: {input norm, q/k/v panels, their bias, o panels, bias, the MLP's input norm, gate/up panels, bias,
  // down panels, bias, q norm, k norm, attention output norm, MLP output norm} (an empty tensor: no bias, no such
  // norm; each norm's weight as it multiplies), its five norms' epsilons (in that order: input, MLP input,
  // per-head, attention output, MLP output) and its window (0: none); then the final norm's weight and epsilon,
  // the LM head's panels and bias; `gated`: the gate/up panels are from `pack_panels_gated` (else stacked, their
  // activation a pass of its own); `act`: the gate's `Activation`. `rope_of_layer`: which set of rotary angles
  // each layer takes (empty: all the first; Gemma3's local and global layers turn at different rates);
  // a layer of -1 has none (SmolLM3's NoPE layers); `softcap` > 0: attention scores soft-capped (Gemma2),
  // `final_softcap` > 0: the logits too; `embed_scale`: the embedding's scale (Gemma's sqrt(hidden), Granite's
  // multiplier), for the tokens `propose` embeds itself; `residual_scale`: the attention's and the MLP's outputs
  // times it before they join the residual stream, `logit_divisor`: the logits divided by it (both Granite's).
  // No input norm or no MLP input norm (OLMo2's, an empty tensor): that input as it is.
  FusedDecoder(std::vector<std::vector<torch::Tensor>> layers, std::vector<double> eps, std::vector<int64_t> windows,
               int64_t heads, int64_t kv_heads, int64_t dim, double scaling, torch::Tensor norm, double norm_eps,
               torch::Tensor head, int64_t vocab, torch::Tensor head_bias, bool gated, int64_t act,
               std::vector<int64_t> rope_of_layer, double softcap, double final_softcap, double embed_scale,
               double residual_scale, double logit_divisor)
      : tensors_(std::move(layers)), eps_(std::move(eps)), windows_(std::move(windows)),
        rope_of_layer_(std::move(rope_of_layer)), heads_(heads), kv_heads_(kv_heads), dim_(dim), scaling_(scaling),
        softcap_(softcap), final_softcap_(final_softcap), embed_scale_(embed_scale), residual_scale_(residual_scale),
        logit_divisor_(logit_divisor), norm_t_(norm.contiguous()),
        norm_eps_(norm_eps), head_t_(head), head_bias_t_(head_bias) {
    TORCH_CHECK(eps_.size() == 5 * tensors_.size() && windows_.size() == tensors_.size(), "FusedDecoder: per-layer settings");
    if (rope_of_layer_.empty()) rope_of_layer_.assign(tensors_.size(), 0);
    TORCH_CHECK(rope_of_layer_.size() == tensors_.size(), "FusedDecoder: one set of rotary angles per layer");
    for (int64_t r : rope_of_layer_) {
      TORCH_CHECK(r >= -1, "FusedDecoder: rotary angle sets");
      rope_sets_ = std::max(rope_sets_, r + 1);
    }
    const int64_t c = norm_t_.numel(), qkv_width = (heads + 2 * kv_heads) * dim;
    for (const auto& t : tensors_) {
      TORCH_CHECK(t.size() == 14, "FusedDecoder: 14 tensors per layer");
      for (int i : {0, 5, 12, 13})
        TORCH_CHECK(t[i].numel() == 0 || t[i].numel() == c, "FusedDecoder: norms of the hidden size");
      const int64_t dq = t[10].numel(), dk = t[11].numel();
      TORCH_CHECK((dq == 0) == (dk == 0) && (dq == 0 || dq == dim || dq == heads * dim) &&
                  (dk == 0 || dk == dim || dk == kv_heads * dim), "FusedDecoder: query and key norms of a head or all heads, both or neither");
      Layer l;
      if (t[0].numel()) l.norm_in = t[0].data_ptr<float>();
      if (t[5].numel()) l.norm_mlp = t[5].data_ptr<float>();
      if (dq) {
        l.q_norm = t[10].data_ptr<float>();
        l.k_norm = t[11].data_ptr<float>();
        l.dq = dq;
        l.dk = dk;
      }
      if (t[12].numel()) l.norm_attn_out = t[12].data_ptr<float>();
      if (t[13].numel()) l.norm_mlp_out = t[13].data_ptr<float>();
      l.qkv = panels_of(t[1], qkv_width, t[2]);
      l.o = panels_of(t[3], c, t[4]);
      l.down = panels_of(t[8], c, t[9]);
      l.gate_up = panels_of(t[6], 2 * l.down.k, t[7], gated, act);
      TORCH_CHECK(l.qkv.k == c && l.o.k == heads * dim && l.gate_up.k == c, "FusedDecoder: projection shapes");
      layers_.push_back(l);
    }
    head_ = panels_of(head_t_, vocab, head_bias_t_);
    TORCH_CHECK(head_.k == c, "FusedDecoder: LM head shape");
  }

  // A decode step: x [M, C] the token embeddings, cos/sin [M, D] their rotary angles (with several sets,
  // [sets, M, D]); keys/values per layer the
  // cache's [slots, kv_heads, D] views of head-major storage; tables per layer group [M, W] int64; ctx [M] each
  // row's context length including its new token (written at position ctx - 1). Returns the logits [M, vocab], or
  // with `greedy` each row's greedy token ([M] int64: their argmax, through the head's screen where it has one).
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> keys,
                        std::vector<torch::Tensor> values, std::vector<torch::Tensor> tables,
                        std::vector<int64_t> group_of_layer, torch::Tensor ctx, int64_t block_size, bool greedy) {
    const int64_t m = x.size(0);
    std::vector<int64_t> rows(m);
    std::iota(rows.begin(), rows.end(), 0);
    return run(x, cos, sin, keys, values, tables, group_of_layer, ctx, std::vector<int64_t>(m, 1), m, rows, block_size,
               greedy);
  }

  // Any step: request j runs qlens[j] rows of x (in order), its last at position ctx[j] - 1; the first
  // `decodes` requests are decodes (one row each, attended as in `forward`), the others prefill chunks
  // (`paged_prefill`); tables [R, W] per group. Returns the logits of rows `keep` only, [len(keep), vocab] (with
  // `greedy`, their greedy tokens, as `forward`).
  torch::Tensor step(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> keys,
                     std::vector<torch::Tensor> values, std::vector<torch::Tensor> tables, std::vector<int64_t> group_of_layer,
                     torch::Tensor ctx, std::vector<int64_t> qlens, int64_t decodes, std::vector<int64_t> keep,
                     int64_t block_size, bool greedy) {
    return run(x, cos, sin, keys, values, tables, group_of_layer, ctx, qlens, decodes, keep, block_size, greedy);
  }

  // Greedy steps (`forward` and `step` with `greedy`) through the LM head's screen (`HeadScreen`; the arguments
  // of `head_screen`). Only for an fp32 head without bias whose logits are neither soft-capped nor divided.
  void screen(torch::Tensor weight, torch::Tensor packed, torch::Tensor scales, torch::Tensor spread, torch::Tensor blocks,
              torch::Tensor feature_blocks) {
    TORCH_CHECK(weight.scalar_type() == panels_dtype(head_) && !head_.bias && final_softcap_ == 0 && logit_divisor_ == 1.0,
                "FusedDecoder.screen: an unquantized LM head (its weights alike) without bias, soft-capping or divisor");
    screen_ = head_screen(head_.n, head_.k, weight, packed, scales, spread, blocks, feature_blocks);
    screen_t_ = {weight, packed, scales, spread, blocks, feature_blocks};
  }

  // (greedy steps still to take without the screen, the steps of the next rest): what the tests look at
  std::pair<int64_t, int64_t> screen_rest() const { return {screen_resting_, screen_rest_}; }

  // k greedy tokens after each row's token `ids` ([M] int64), one `forward` each with no Python between them
  // (the draft of a speculative step): pass j embeds each row's latest token (rows of `embedding` [V, C], times
  // the embedding's scale) at position ctx - 1 + j with the angles cos/sin[..., j, :] ([(sets,) M, >= k, D]).
  // Returns [M, k] int64.
  torch::Tensor propose(torch::Tensor embedding, torch::Tensor ids, torch::Tensor cos, torch::Tensor sin,
                        std::vector<torch::Tensor> keys, std::vector<torch::Tensor> values, std::vector<torch::Tensor> tables,
                        std::vector<int64_t> group_of_layer, torch::Tensor ctx, int64_t block_size, int64_t k) {
    TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kLong && cos.dim() >= 3 && cos.size(-3) == ids.size(0) &&
                cos.size(-2) >= k && sin.sizes() == cos.sizes(), "FusedDecoder.propose: ids [M], angles [(sets,) M, >= k, D]");
    auto out = torch::empty({ids.size(0), k}, ids.options());
    torch::Tensor last = ids;
    const int64_t at = cos.dim() - 2;
    for (int64_t j = 0; j < k; ++j) {
      auto x = embedding.index_select(0, last).to(torch::kFloat);  // (a bf16 model's rows, widened)
      if (embed_scale_ != 1.0) x.mul_((float)embed_scale_);  // as the model's embedding: times its fp32 scale
      last = forward(x, cos.select(at, j).contiguous(), sin.select(at, j).contiguous(), keys, values, tables,
                     group_of_layer, ctx + j, block_size, true);
      out.select(1, j).copy_(last);
    }
    return out;
  }

 private:
  torch::Tensor run(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, std::vector<torch::Tensor>& keys,
                    std::vector<torch::Tensor>& values, const std::vector<torch::Tensor>& tables,
                    const std::vector<int64_t>& group_of_layer, const torch::Tensor& ctx, const std::vector<int64_t>& qlens,
                    int64_t decodes, const std::vector<int64_t>& keep, int64_t block_size, bool greedy) {
    const int64_t m = x.size(0), c = x.size(1), d = dim_, h = heads_, kvh = kv_heads_, requests = ctx.numel();
    const bool small = m <= 2;  // on the pool (see `parallel`)
    const size_t num_layers = layers_.size();
    TORCH_CHECK(x.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() && ctx.is_contiguous() &&
                x.scalar_type() == torch::kFloat && ctx.scalar_type() == torch::kLong && cos.numel() == rope_sets_ * m * d &&
                sin.numel() == rope_sets_ * m * d && c == norm_t_.numel(),
                "FusedDecoder: contiguous fp32 rows and angles (one set per kind of layer), int64 lengths");
    TORCH_CHECK(keys.size() == num_layers && values.size() == num_layers && group_of_layer.size() == num_layers,
                "FusedDecoder: one cache tensor per layer");
    TORCH_CHECK((int64_t)qlens.size() == requests && decodes >= 0 && decodes <= requests, "FusedDecoder: one query length per request");
    for (const auto& t : tables)
      TORCH_CHECK(t.is_contiguous() && t.scalar_type() == torch::kLong && t.size(0) == requests, "FusedDecoder: int64 tables");
    const int64_t* cp = ctx.data_ptr<int64_t>();
    std::vector<int64_t> starts(requests + 1, 0);  // each request's first row
    for (int64_t j = 0; j < requests; ++j) {
      TORCH_CHECK(qlens[j] >= 1 && qlens[j] <= cp[j] && (j >= decodes || qlens[j] == 1), "FusedDecoder: query lengths");
      starts[j + 1] = starts[j] + qlens[j];
    }
    TORCH_CHECK(starts[requests] == m, "FusedDecoder: the query lengths sum to the rows");
    for (int64_t r : keep) TORCH_CHECK(r >= 0 && r < m, "FusedDecoder: rows to keep");
    // each row's write slot, per group
    std::vector<std::vector<int64_t>> slots(tables.size(), std::vector<int64_t>(m));
    for (size_t g = 0; g < tables.size(); ++g) {
      const int64_t* tp = tables[g].data_ptr<int64_t>();
      const int64_t width = tables[g].size(1);
      for (int64_t j = 0; j < requests; ++j)
        for (int64_t i = 0; i < qlens[j]; ++i) {
          const int64_t pos = cp[j] - qlens[j] + i;
          TORCH_CHECK(pos / block_size < width, "FusedDecoder: context beyond the block table");
          slots[g][starts[j] + i] = tp[j * width + pos / block_size] * block_size + pos % block_size;
        }
    }
    // prefill chunks' rows counted from the first of them
    std::vector<int64_t> chunk_starts(starts.begin() + decodes, starts.end() - 1);
    for (int64_t& s : chunk_starts) s -= starts[decodes];
    const int64_t qkv_width = (h + 2 * kvh) * d, inter = layers_.empty() ? 0 : layers_[0].down.k, nd = starts[decodes];
    const bool gated = !layers_.empty() && layers_[0].gate_up.gated;  // (every layer alike: the constructor's flag)
    Buffer xs(m * c), hn(m * c), y(m * qkv_width), attn(m * h * d), o(m * c), sum(m * c), gu(gated ? 0 : m * 2 * inter),
        act(m * inter);
    float* xp = xs.get();
    std::copy(x.data_ptr<float>(), x.data_ptr<float>() + m * c, xp);
    for (size_t i = 0; i < num_layers; ++i) {
      const Layer& l = layers_[i];
      torch::Tensor& kc = keys[i];
      torch::Tensor& vc = values[i];
      const int64_t rd = kc.scalar_type() == torch::kChar ? d + 4 : d;  // a cache row's elements
      TORCH_CHECK(kc.dim() == 3 && kc.size(1) == kvh && kc.size(2) == rd && kc.stride(2) == 1 && kc.stride(0) == rd &&
                  kc.stride(1) == kc.size(0) * rd && vc.strides() == kc.strides() && vc.sizes() == kc.sizes(),
                  "FusedDecoder: head-major cache");
      const int64_t slots_per_head = kc.size(0), g = group_of_layer[i], width = tables[g].size(1);
      const int64_t* tp = tables[g].data_ptr<int64_t>();
      if (l.norm_in) rms_rows(xp, nullptr, l.norm_in, eps_[5 * i], m, c, hn.get(), nullptr, small);
      panel_rows(l.norm_in ? hn.get() : xp, m, l.qkv, y.get(), small);
      if (l.q_norm)
        head_norm_rows(y.get(), m, qkv_width, h * d, l.dq, l.q_norm, kvh * d, l.dk, l.k_norm, eps_[5 * i + 2], small);
      if (rope_of_layer_[i] >= 0) {
        const int64_t angles = rope_of_layer_[i] * m * d;
        rotary_rows(y.get(), m, qkv_width, cos.data_ptr<float>() + angles, sin.data_ptr<float>() + angles, d, h + kvh, small);
      }
      with_cache(kc, vc, [&](auto* kp, auto* vp) {
        for (int64_t r = 0; r < m; ++r) {  // this step's keys and values into the cache
          const float* kr = y.get() + r * qkv_width + h * d;
          const float* vr = kr + kvh * d;
          for (int64_t j = 0; j < kvh; ++j) {
            store_row(kr + j * d, d, kp + (j * slots_per_head + slots[g][r]) * rd);
            store_row(vr + j * d, d, vp + (j * slots_per_head + slots[g][r]) * rd);
          }
        }
        const auto attention_start = std::chrono::steady_clock::now();
        if (decodes)
          decode_attention(y.get(), qkv_width, nd, h, d, kp, vp, kvh, slots_per_head, tp, width, cp, attn.get(), scaling_,
                           windows_[i], block_size, small, (float)softcap_);
        if (decodes < requests)
          prefill_attention(y.get() + nd * qkv_width, qkv_width, m - nd, h, d, kp, vp, kvh, slots_per_head,
                            tp + decodes * width, width, cp + decodes, qlens.data() + decodes, chunk_starts.data(),
                            requests - decodes, attn.get() + nd * h * d, scaling_, windows_[i], block_size, (float)softcap_);
        attention_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - attention_start).count();
      });
      panel_rows(attn.get(), m, l.o, o.get(), small);
      if (l.norm_attn_out) rms_rows(o.get(), nullptr, l.norm_attn_out, eps_[5 * i + 3], m, c, o.get(), nullptr, small);
      if (residual_scale_ != 1.0) scale_rows(o.get(), m * c, (float)residual_scale_);
      const float* mlp_in = hn.get();
      if (l.norm_mlp) {
        rms_rows(o.get(), xp, l.norm_mlp, eps_[5 * i + 1], m, c, hn.get(), sum.get(), small);
      } else {  // the MLP takes the residual stream as it is
        add_rows(o.get(), xp, m * c, sum.get());
        mlp_in = sum.get();
      }
      if (gated) {
        panel_rows(mlp_in, m, l.gate_up, act.get(), small);
      } else {
        panel_rows(mlp_in, m, l.gate_up, gu.get(), small);
        gated_rows(gu.get(), m, inter, act.get(), small, l.gate_up.act);
      }
      if (l.norm_mlp_out || residual_scale_ != 1.0) {  // x = sum + norm(down(act)) (times the scale)
        panel_rows(act.get(), m, l.down, o.get(), small);
        if (l.norm_mlp_out) rms_rows(o.get(), nullptr, l.norm_mlp_out, eps_[5 * i + 4], m, c, o.get(), nullptr, small);
        if (residual_scale_ != 1.0) scale_rows(o.get(), m * c, (float)residual_scale_);
        add_rows(sum.get(), o.get(), m * c, xp);
      } else {
        panel_rows(act.get(), m, l.down, xp, small, sum.get());  // x = sum + down(act)
      }
    }
    const int64_t kept = keep.size();
    for (int64_t r = 0; r < kept; ++r) std::copy(xp + keep[r] * c, xp + (keep[r] + 1) * c, o.get() + r * c);
    rms_rows(o.get(), nullptr, norm_t_.data_ptr<float>(), norm_eps_, kept, c, hn.get(), nullptr, small);
    if (greedy && screen_.scale && kept > 0) {
      if (screen_resting_ == 0) {
        int64_t missed = 0;
        auto tokens = screened_argmax(hn.get(), kept, head_, screen_, kept <= 2, &missed);
        screen_rows_ += kept;
        screen_missed_ += missed;
        if (screen_rows_ >= 128) {  // over a quarter of the rows took every logit: the plain head for a while
          if (4 * screen_missed_ > screen_rows_) {
            screen_resting_ = screen_rest_;
            screen_rest_ = std::min<int64_t>(SCREEN_REST_MOST, 2 * screen_rest_);
          } else {
            screen_rest_ = SCREEN_REST;
          }
          screen_rows_ = screen_missed_ = 0;
        }
        return torch::tensor(tokens, ctx.options());
      }
      --screen_resting_;
    }
    auto logits = torch::empty({kept, head_.n}, x.options());
    panel_rows(hn.get(), kept, head_, logits.data_ptr<float>(), kept <= 2);
    if (final_softcap_ > 0) logits.div_(final_softcap_).tanh_().mul_(final_softcap_);  // as transformers' Gemma2
    if (logit_divisor_ != 1.0) logits.div_(logit_divisor_);  // (Granite's)
    return greedy ? torch::tensor(argmax_rows(logits), ctx.options()) : logits;
  }

  static void scale_rows(float* x, int64_t n, float s) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) x[j] *= s;
  }

  static void add_rows(const float* a, const float* b, int64_t n, float* out) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) out[j] = a[j] + b[j];
  }

  struct Buffer {  // uninitialised floats (a vector's zeros cost a pass over every step's buffers)
    explicit Buffer(int64_t n) : p(new float[n]) {}
    float* get() const { return p.get(); }
    std::unique_ptr<float[]> p;
  };

  struct Layer {
    const float* norm_in = nullptr;  // (none: OLMo2's)
    const float* norm_mlp = nullptr;
    const float* q_norm = nullptr;  // query and key norms (Qwen3, Gemma3: of a head; OLMo2: of all heads; else none)
    const float* k_norm = nullptr;
    int64_t dq = 0, dk = 0;  // their widths
    const float* norm_attn_out = nullptr;  // norms of the attention's and the MLP's outputs (Gemma2, Gemma3)
    const float* norm_mlp_out = nullptr;
    Panels qkv, o, gate_up, down;
  };
  std::vector<std::vector<torch::Tensor>> tensors_;  // keeps the weights the raw pointers read alive
  std::vector<Layer> layers_;
  std::vector<double> eps_;
  std::vector<int64_t> windows_, rope_of_layer_;
  int64_t rope_sets_ = 1, heads_, kv_heads_, dim_;
  double scaling_, softcap_, final_softcap_, embed_scale_, residual_scale_, logit_divisor_;
  torch::Tensor norm_t_;
  double norm_eps_;
  torch::Tensor head_t_, head_bias_t_;
  Panels head_;
  std::vector<torch::Tensor> screen_t_;  // keeps the screen's tensors alive
  HeadScreen screen_;  // (no `scale`: none)
  int64_t screen_rows_ = 0, screen_missed_ = 0;  // rows screened lately, and of them those that took every logit
  int64_t screen_resting_ = 0;  // greedy steps still to take without the screen
  int64_t screen_rest_ = SCREEN_REST;  // the steps of the next rest

 public:
  // Seconds spent in attention (decode and prefill, every layer) since the decoder was built: where a step's
  // time goes, for benchmarks (two clock reads a layer).
  double attention_s_ = 0;
};

// The kernels run without the GIL, so the engine's event loop goes on while a forward computes.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_decode", &paged_decode, nogil);
  m.def("paged_prefill", &paged_prefill, nogil);
  m.def("quantize_kv", &quantize_kv, nogil);
  m.def("pack_panels", &pack_panels);
  m.def("pack_panels_gated", &pack_panels_gated);
  m.def("pack_panels_int8", &pack_panels_int8);
  m.def("pack_panels_w8a8", &pack_panels_w8a8);
  m.def("vnni_panels", &vnni_panels);
  m.def("bf16_unit", &bf16_unit, py::arg("set") = py::none());
  m.def("panel_linear", &panel_linear, py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("b"), py::arg("gated") = false,
        py::arg("act") = 0, nogil);
  m.def("rms_norm", &rms_norm, nogil);
  m.def("rotary_", &rotary_, nogil);
  m.def("head_norm_", &head_norm_, nogil);
  m.def("gated_act", &gated_act, py::arg("gu"), py::arg("act") = 0, nogil);
  m.def("argmax_rows", &argmax_rows, nogil);
  m.def("screened_argmax_rows", &screened_argmax_rows, nogil);
  m.def("has_vnni", [] {  // whether int8 products run on AVX-512 VNNI here (else `a8_rows` is scalar code)
#ifdef __AVX512VNNI__
    return true;
#else
    return false;
#endif
  });
  py::class_<FusedDecoder>(m, "FusedDecoder")
      .def(py::init<std::vector<std::vector<torch::Tensor>>, std::vector<double>, std::vector<int64_t>, int64_t, int64_t,
                    int64_t, double, torch::Tensor, double, torch::Tensor, int64_t, torch::Tensor, bool, int64_t,
                    std::vector<int64_t>, double, double, double, double, double>(),
           py::arg("layers"), py::arg("eps"), py::arg("windows"), py::arg("heads"), py::arg("kv_heads"), py::arg("dim"),
           py::arg("scaling"), py::arg("norm"), py::arg("norm_eps"), py::arg("head"), py::arg("vocab"), py::arg("head_bias"),
           py::arg("gated") = false, py::arg("act") = 0, py::arg("rope_of_layer") = std::vector<int64_t>(),
           py::arg("softcap") = 0.0, py::arg("final_softcap") = 0.0, py::arg("embed_scale") = 1.0,
           py::arg("residual_scale") = 1.0, py::arg("logit_divisor") = 1.0)
      .def("forward", &FusedDecoder::forward, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("keys"),
           py::arg("values"), py::arg("tables"), py::arg("group_of_layer"), py::arg("ctx"), py::arg("block_size"),
           py::arg("greedy") = false, nogil)
      .def("step", &FusedDecoder::step, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("keys"), py::arg("values"),
           py::arg("tables"), py::arg("group_of_layer"), py::arg("ctx"), py::arg("qlens"), py::arg("decodes"),
           py::arg("keep"), py::arg("block_size"), py::arg("greedy") = false, nogil)
      .def("screen", &FusedDecoder::screen)
      .def_property_readonly("screen_rest", &FusedDecoder::screen_rest)
      .def("propose", &FusedDecoder::propose, nogil)
      .def_readonly("attention_seconds", &FusedDecoder::attention_s_);
}
