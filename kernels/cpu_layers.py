"""Llama-like decoder layers on CPU in a dozen calls each instead of about sixty.

transformers' decoder layer runs ~15 module calls and ~45 small torch ops per layer; at batch 1 on SmolLM2
those cost about a quarter of a step (~8 of ~32 ms). While `FusedLayers` is entered, each supported layer instead runs:
RMSNorm (C++), one linear over q, k and v stacked, rotary embedding in place (C++), the engine's attention
backend, the output projection, residual add + RMSNorm (C++), one linear over gate and up that computes
SiLU·up in the same pass (C++; where the MLP's width is not a multiple of 16, stacked and then SiLU·up in a
pass of its own), the down projection and the residual add. Linears go through `cpu_linear.PanelLinear` (one packed copy
of the stacked weights, C++).

Supported: transformers' Llama, Mistral, Qwen2, Qwen3 (per-head query and key norms, C++) and Phi3 (q/k/v and
gate/up already one linear each; rotary over whole heads) decoder layers with SiLU MLPs, fp32 on CPU; other
layers run unchanged.

Where every decoder layer of a causal LM in `DECODER_MODELS` is fused, steps skip even those calls:
`FusedDecoder` runs all the layers, the final norm and the LM head in one C++ call (the same kernels in the
same order, over the same packed weights), the embedding and rotary angles through the model's own modules.
At batch 1 on SmolLM2 the Python between the layers was ~4 ms of a ~23 ms step; in mixed-64's prefill steps
~0.3 s of 6. `FusedDecoder.speculate` runs speculative decode steps: the same decoder over int8 copies of the
weights proposes tokens, the fp32 one checks them all in one pass.

`FusedLayers(model, quantized="int8")` (`EngineConfig.weights`) packs every one of those linears, the LM head
included, as int8 (`cpu_linear.PanelLinear(quantized=...)`; "w8a8": int8 activations too): the same kernels
and order, a quarter of the weights' bytes. Such a decoder is its own draft.
"""

from __future__ import annotations

import torch
from torch import nn

from jitney.kernels import cpu_linear, native
from jitney.kernels.base import jitney_attention


def _no_window(layer) -> None:
    return None


def _config_window(layer) -> int | None:
    return getattr(layer.self_attn.config, "sliding_window", None)


def _module_window(layer) -> int | None:
    return getattr(layer.self_attn, "sliding_window", None)


# Where each supported layer class (whose forward is replicated here) takes its attention's window from.
WINDOW_OF = {"LlamaDecoderLayer": _no_window, "MistralDecoderLayer": _config_window, "Qwen2DecoderLayer": _module_window,
             "Qwen3DecoderLayer": _module_window, "Phi3DecoderLayer": _config_window}
HEAD_NORMS = {"Qwen3DecoderLayer"}
"""Layers that normalise each query and key head (`q_norm`, `k_norm`) before the rotary embedding."""
STACKED_PROJECTIONS = {"Phi3DecoderLayer"}
"""Layers whose q/k/v and gate/up projections are one linear each already (`qkv_proj`, `gate_up_proj`)."""


def _groups(layer: nn.Module) -> tuple[list[nn.Linear], list[nn.Linear], list[nn.Linear], list[nn.Linear]]:
    """A supported layer's linears as the fused path computes them, each group as one: q/k/v, o, gate/up, down."""
    attn, mlp = layer.self_attn, layer.mlp
    if type(layer).__name__ in STACKED_PROJECTIONS:
        return [attn.qkv_proj], [attn.o_proj], [mlp.gate_up_proj], [mlp.down_proj]
    return [attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj], [mlp.gate_proj, mlp.up_proj], [mlp.down_proj]


def _heads(layer: nn.Module) -> tuple[int, int]:
    """Query and key/value heads of a supported layer, from its projections' widths."""
    qkv, (o,), _, _ = _groups(layer)
    dim = layer.self_attn.head_dim
    heads = o.in_features // dim
    return heads, (sum(m.out_features for m in qkv) - heads * dim) // (2 * dim)


def supported(layer: nn.Module) -> bool:
    """Whether `layer` is a decoder layer this module runs fused."""
    if type(layer).__name__ not in WINDOW_OF or "forward" in vars(layer):
        return False
    attn, mlp = layer.self_attn, layer.mlp
    linears = [m for group in _groups(layer) for m in group]
    act = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)
    rope = getattr(attn.config, "rope_parameters", None) or {}
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if type(layer).__name__ in HEAD_NORMS:
        norms += [attn.q_norm, attn.k_norm]
        if any(n.weight.numel() != attn.head_dim for n in norms[2:]):
            return False
    weights = [m.weight for m in linears] + [n.weight for n in norms]
    return (
        all(type(m) is nn.Linear for m in linears)
        and all(w.dtype == torch.float32 and w.device.type == "cpu" for w in weights)
        and type(act).__name__ == "SiLUActivation"
        and rope.get("partial_rotary_factor", 1.0) == 1.0  # (the rotary kernel turns whole heads)
        and all(hasattr(n, "variance_epsilon") and "forward" not in vars(n) for n in norms)
    )


class FusedLayers:
    """While entered, every supported decoder layer of `model` runs fused (see the module's docstring);
    `quantized`: over int8 copies of the weights ("int8" or "w8a8", `cpu_linear.PanelLinear`)."""

    def __init__(self, model: nn.Module, quantized: str | None = None):
        self.model = model
        self.quantized = quantized
        self.patched: list[nn.Module] = []
        self.linears: set[nn.Linear] = set()
        """The linear layers computed here (`PackedLinears` can skip them)."""
        self.decoder: FusedDecoder | None = None
        """A step in one call, where the whole model is fused."""

    def __enter__(self) -> "FusedLayers":
        kernels = native.load()
        whole = FusedDecoder.supports(self.model)  # asked before the layers are patched
        packs = {}
        for layer in self.model.modules():
            if supported(layer):
                packs[layer] = _LayerLinears(layer, self.quantized)
                layer.forward = _fused_forward(layer, packs[layer], kernels)
                self.patched.append(layer)
                self.linears.update(m for group in _groups(layer) for m in group)
        if whole:
            head = self.model.lm_head
            head.forward = packed_head = _stacked([head], self.quantized)  # the decoder's and the model's forward share it
            self.patched.append(head)
            self.linears.add(head)
            self.decoder = FusedDecoder(self.model, packs, packed_head, kernels, self.quantized)
        return self

    def __exit__(self, *exc_info) -> None:
        for module in self.patched:
            del module.forward  # back to the class's forward
        self.patched, self.linears, self.decoder = [], set(), None


# Causal LMs whose forward is embed -> rotary angles -> every decoder layer -> final norm -> LM head, nothing else.
DECODER_MODELS = {"LlamaForCausalLM": "LlamaModel", "MistralForCausalLM": "MistralModel", "Qwen2ForCausalLM": "Qwen2Model",
                  "Qwen3ForCausalLM": "Qwen3Model", "Phi3ForCausalLM": "Phi3Model"}


class FusedDecoder:
    """Steps with every decoder layer, the final norm and the LM head in one C++ call (`cpu_kernels.cpp`).
    Module hooks registered on those modules do not run for these steps (nor does transformers' layer forward)."""

    @staticmethod
    def supports(model: nn.Module) -> bool:
        """Whether `model` is one of `DECODER_MODELS`, unmodified, with every decoder layer fusable and a plain
        fp32 LM head."""
        inner = getattr(model, "model", None)
        head = getattr(model, "lm_head", None)
        return (
            DECODER_MODELS.get(type(model).__name__) == type(inner).__name__
            and "forward" not in vars(model) and "forward" not in vars(inner)
            and len(inner.layers) == model.config.get_text_config().num_hidden_layers
            and all(supported(layer) for layer in inner.layers)
            and type(head) is nn.Linear and "forward" not in vars(head)
            and head.weight.dtype == torch.float32 and head.weight.device.type == "cpu"
            and "forward" not in vars(inner.norm) and hasattr(inner.norm, "variance_epsilon")
        )

    def __init__(self, model: nn.Module, packs: dict[nn.Module, "_LayerLinears"], head: cpu_linear.PanelLinear, kernels,
                 quantized: str | None = None):
        self.model = model
        self.kernels = kernels
        layers = []
        for layer in model.model.layers:
            p = packs[layer]
            layers.append([p.qkv.packed, p.qkv.bias, p.o.packed, p.o.bias, p.gate_up.packed, p.gate_up.bias, p.down.packed,
                           p.down.bias])
        (gated,) = {packs[layer].gate_up.gated for layer in model.model.layers}  # (one MLP width for every layer)
        self.native = self._native(layers, head.packed, head.bias, gated=gated)
        self._draft = self.native if quantized else None
        self.argmax = kernels.argmax_rows
        """torch.argmax's tokens, off OpenMP (see `argmax_rows` in `cpu_kernels.cpp`)."""

    def _native(self, layers: list[list[torch.Tensor | None]], head: torch.Tensor, head_bias: torch.Tensor | None,
                gated: bool = False):
        """The C++ decoder over these packed linears (per layer: q/k/v, o, gate/up and down, each with its bias;
        `gated`: every gate/up from `pack_panels_gated`)."""
        model = self.model
        specs, eps, windows = [], [], []
        empty = torch.empty(0)  # no bias, no per-head norm
        for layer, (qkv, qkv_b, o, o_b, gate_up, gate_up_b, down, down_b) in zip(model.model.layers, layers):
            heads = _head_norms(layer)
            tensors = [layer.input_layernorm.weight.detach(), qkv, qkv_b, o, o_b, layer.post_attention_layernorm.weight.detach(),
                       gate_up, gate_up_b, down, down_b, *(n.weight.detach() if n else None for n in heads)]
            specs.append([empty if t is None else t.contiguous() for t in tensors])
            eps += [layer.input_layernorm.variance_epsilon, layer.post_attention_layernorm.variance_epsilon,
                    heads[0].variance_epsilon if heads[0] else 0.0]
            windows.append(WINDOW_OF[type(layer).__name__](layer) or 0)
        attn = model.model.layers[0].self_attn
        dim, norm = attn.head_dim, model.model.norm
        return self.kernels.FusedDecoder(specs, eps, windows, *_heads(model.model.layers[0]), dim, attn.scaling,
                                         norm.weight.detach(), norm.variance_epsilon, head, model.lm_head.out_features,
                                         empty if head_bias is None else head_bias, gated)

    @property
    def draft(self):
        """The same decoder over int8 copies of the weights (each output feature on its own scale: a quarter of
        the fp32 weights' memory; packed at the first use), which proposes the tokens `speculate` checks. With
        quantized weights, the decoder itself."""
        if self._draft is None:
            pack = cpu_linear.pack_int8
            layers = []
            for layer in self.model.model.layers:
                packed = []
                for linears in _groups(layer):
                    packed += [pack([m.weight.detach() for m in linears]), _stacked_bias(linears)]
                layers.append(packed)
            head = self.model.lm_head
            self._draft = self._native(layers, pack([head.weight.detach()]), _stacked_bias([head]))
        return self._draft

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, step, started) -> torch.Tensor:
        """Logits [rows, vocab] of a decode-only step (`StepInputs` `step`, every row one token); `started()`
        is called just before the C++ call (which releases the GIL)."""
        inner = self.model.model
        x = inner.embed_tokens(input_ids)  # [1, rows, hidden]
        cos, sin = inner.rotary_emb(x, positions[None])
        x, cos, sin = x[0].contiguous(), cos[0].contiguous(), sin[0].contiguous()
        started()
        return self.native.forward(x, cos, sin, step.keys, step.values, step.block_tables, step.group_of_layer,
                                   step.context_tensor, step.block_size)

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, step, keep: list[int], started) -> torch.Tensor:
        """Logits [len(keep), vocab] of rows `keep` of any step (prefill chunks too) in one C++ call: the same
        kernels as the fused layers' Python path, in the same order."""
        inner = self.model.model
        x = inner.embed_tokens(input_ids)
        cos, sin = inner.rotary_emb(x, positions[None])
        x, cos, sin = x[0].contiguous(), cos[0].contiguous(), sin[0].contiguous()
        started()
        return self.native.step(x, cos, sin, step.keys, step.values, step.block_tables, step.group_of_layer,
                                step.context_tensor, step.query_lens, step.num_decodes, keep, step.block_size)

    def speculate(self, input_ids: torch.Tensor, positions: torch.Tensor, step, k: int, started) -> list[list[int]]:
        """The greedy tokens of a decode-only step, one to k + 1 per row (speculative decoding).

        The int8 `draft` proposes k tokens after each row's, one pass at a time (writing its own keys and
        values into the row's next k cache slots); then one pass of the model itself runs each row's token and
        its k proposals as k + 1 rows of consecutive positions over the same block table, overwriting those
        slots. A row's tokens are the model's own up to and including the first that differs from the proposal
        (those after it followed from a wrong token). Each of those passes' rows computes as it would alone
        (every kernel here sums a row's outputs in the same order whatever the number of rows), so the tokens
        are the same as k + 1 decode steps one after another would give."""
        inner = self.model.model
        rows, width = input_ids.shape[1], k + 1
        span = (positions[:, None] + torch.arange(width)).reshape(1, -1)  # [1, rows * width]
        cos, sin = inner.rotary_emb(inner.embed_tokens.weight[:1], span)
        cos, sin = cos[0].view(rows, width, -1), sin[0].view(rows, width, -1)
        ctx, tables = step.context_tensor, step.block_tables
        draft = self.draft
        started()
        proposed = draft.propose(inner.embed_tokens.weight.detach(), input_ids[0], cos, sin, step.keys, step.values, tables,
                                 step.group_of_layer, ctx, step.block_size, k)
        ids = torch.cat([input_ids[0][:, None], proposed], 1)  # [rows, width]
        logits = self.native.forward(
            inner.embed_tokens(ids.reshape(-1)), cos.reshape(rows * width, -1), sin.reshape(rows * width, -1), step.keys,
            step.values, [t.repeat_interleave(width, 0) for t in tables], step.group_of_layer,
            (ctx[:, None] + torch.arange(width)).reshape(-1), step.block_size,
        )
        best, ids = self.argmax(logits), ids.tolist()
        runs = []
        for r in range(rows):
            run = best[r * width : (r + 1) * width]
            accepted = next((j for j in range(k) if run[j] != ids[r][j + 1]), k)
            runs.append(run[: accepted + 1])
        return runs


def _stacked_bias(linears: list[nn.Linear]) -> torch.Tensor | None:
    """The biases of linears computed as one, stacked (zeros for those without); None if none has one."""
    if all(m.bias is None for m in linears):
        return None
    return torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears])


def _stacked(linears: list[nn.Linear], quantized: str | None = None) -> cpu_linear.PanelLinear:
    """One packed linear over several that share an input (their weights stay as they are)."""
    return cpu_linear.PanelLinear([m.weight.detach() for m in linears], _stacked_bias(linears), quantized=quantized)


class _LayerLinears:
    """A decoder layer's four packed linears: q/k/v stacked, o, gate/up (gated: SiLU·up in the same pass, where
    the MLP's width is a multiple of 16 and the weights fp32; else stacked) and down."""

    def __init__(self, layer: nn.Module, quantized: str | None = None):
        qkv, o, gate_up, down = _groups(layer)
        self.qkv = _stacked(qkv, quantized)
        self.o = _stacked(o, quantized)
        width = sum(m.out_features for m in gate_up) // 2  # the MLP's
        if width % 16 == 0 and not quantized:
            weights = [m.weight.detach() for m in gate_up]
            gate_and_up = weights if len(weights) == 2 else list(weights[0].split(width))  # (one linear: its halves)
            self.gate_up = cpu_linear.PanelLinear(gate_and_up, _stacked_bias(gate_up), gated=True)
        else:
            self.gate_up = _stacked(gate_up, quantized)
        self.down = _stacked(down, quantized)


def _head_norms(layer: nn.Module) -> tuple:
    """The layer's per-head query and key norms, or (None, None)."""
    if type(layer).__name__ in HEAD_NORMS:
        return layer.self_attn.q_norm, layer.self_attn.k_norm
    return None, None


def _fused_forward(layer: nn.Module, linears: _LayerLinears, kernels):
    attn = layer.self_attn
    q_norm, k_norm = _head_norms(layer)
    qkv, o_proj, gate_up, down = linears.qkv, linears.o, linears.gate_up, linears.down
    dim = attn.head_dim
    heads, kv_heads = _heads(layer)
    norm_in, norm_post = layer.input_layernorm, layer.post_attention_layernorm
    window = WINDOW_OF[type(layer).__name__](layer)

    def forward(hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                position_embeddings=None, **kwargs):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1]).contiguous()
        t = x.shape[0]
        h, _ = kernels.rms_norm(x, None, norm_in.weight, norm_in.variance_epsilon)
        y = qkv(h)  # [T, (heads + 2 kv_heads) * dim]
        if q_norm is not None:
            kernels.head_norm_(y, heads, kv_heads, q_norm.weight, k_norm.weight, q_norm.variance_epsilon)
        cos, sin = (c if c.is_contiguous() else c.contiguous() for c in position_embeddings)  # [1, T, dim]
        kernels.rotary_(y, cos, sin, heads + kv_heads)
        q = y[:, : heads * dim].view(t, heads, dim).transpose(0, 1)[None]
        k = y[:, heads * dim : (heads + kv_heads) * dim].view(t, kv_heads, dim).transpose(0, 1)[None]
        v = y[:, (heads + kv_heads) * dim :].view(t, kv_heads, dim).transpose(0, 1)[None]
        out, _ = jitney_attention(attn, q, k, v, None, scaling=attn.scaling, sliding_window=window, **kwargs)
        h, x = kernels.rms_norm(o_proj(out.reshape(t, heads * dim)), x, norm_post.weight, norm_post.variance_epsilon)
        x = x + down(gate_up(h) if gate_up.gated else kernels.silu_mul(gate_up(h)))
        return x.view(shape)

    return forward
