// Part of the kernels' one translation unit: cpu_kernels.cpp includes the parts in order, each using those
// before it. This one: the one-call decoder (`FusedDecoder`).
#pragma once

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
