// Part of the kernels' one translation unit: cpu_kernels.cpp includes the parts in order, each using those
// before it. This one: prefill attention over the paged cache (`paged_prefill`).
#pragma once

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
