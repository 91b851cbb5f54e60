"""Llama-like decoder layers on CPU in a dozen calls each instead of about sixty.

transformers' decoder layer runs ~15 module calls and ~45 small torch ops per layer; at batch 1 on SmolLM2
those cost about a quarter of a step (~8 of ~32 ms). While `FusedLayers` is entered, each supported layer instead runs:
RMSNorm (C++), one linear over q, k and v stacked, rotary embedding in place (C++), the engine's attention
backend, the output projection, residual add + RMSNorm (C++), one linear over gate and up stacked, SiLU·up
(C++), the down projection and the residual add. Linears go through `cpu_linear.PanelLinear` (one packed copy
of the stacked weights, C++).

Supported: transformers' Llama, Mistral and Qwen2 decoder layers with SiLU MLPs, fp32 on CPU; other layers
run unchanged.

Where every decoder layer of a Llama, Mistral or Qwen2 causal LM is fused, decode steps skip even those calls:
`FusedDecoder` runs all the layers, the final norm and the LM head in one C++ call (the same kernels in the
same order, over the same packed weights), the embedding and rotary angles through the model's own modules.
At batch 1 on SmolLM2 the Python between the layers was ~4 ms of a ~23 ms step.
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
WINDOW_OF = {"LlamaDecoderLayer": _no_window, "MistralDecoderLayer": _config_window, "Qwen2DecoderLayer": _module_window}


def supported(layer: nn.Module) -> bool:
    """Whether `layer` is a decoder layer this module runs fused."""
    if type(layer).__name__ not in WINDOW_OF or "forward" in vars(layer):
        return False
    attn, mlp = layer.self_attn, layer.mlp
    linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    weights = [m.weight for m in linears] + [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    return (
        all(type(m) is nn.Linear for m in linears)
        and all(w.dtype == torch.float32 and w.device.type == "cpu" for w in weights)
        and type(mlp.act_fn).__name__ == "SiLUActivation"
        and hasattr(layer.input_layernorm, "variance_epsilon")
    )


class FusedLayers:
    """While entered, every supported decoder layer of `model` runs fused (see the module's docstring)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.patched: list[nn.Module] = []
        self.linears: set[nn.Linear] = set()
        """The linear layers computed here (`PackedLinears` can skip them)."""
        self.decoder: FusedDecoder | None = None
        """A decode step in one call, where the whole model is fused."""

    def __enter__(self) -> "FusedLayers":
        kernels = native.load()
        whole = FusedDecoder.supports(self.model)  # asked before the layers are patched
        packs = {}
        for layer in self.model.modules():
            if supported(layer):
                attn, mlp = layer.self_attn, layer.mlp
                packs[layer] = _LayerLinears(layer)
                layer.forward = _fused_forward(layer, packs[layer], kernels)
                self.patched.append(layer)
                self.linears.update([attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj])
        if whole:
            head = self.model.lm_head
            head.forward = packed_head = _stacked([head])  # the decoder's and the model's forward share it
            self.patched.append(head)
            self.linears.add(head)
            self.decoder = FusedDecoder(self.model, packs, packed_head, kernels)
        return self

    def __exit__(self, *exc_info) -> None:
        for module in self.patched:
            del module.forward  # back to the class's forward
        self.patched, self.linears, self.decoder = [], set(), None


# Causal LMs whose forward is embed -> rotary angles -> every decoder layer -> final norm -> LM head, nothing else.
DECODER_MODELS = {"LlamaForCausalLM": "LlamaModel", "MistralForCausalLM": "MistralModel", "Qwen2ForCausalLM": "Qwen2Model"}


class FusedDecoder:
    """Decode steps with every decoder layer, the final norm and the LM head in one C++ call (`cpu_kernels.cpp`).
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

    def __init__(self, model: nn.Module, packs: dict[nn.Module, "_LayerLinears"], head: cpu_linear.PanelLinear, kernels):
        self.model = model
        specs, eps, windows = [], [], []
        empty = head.packed.new_empty(0)  # no bias
        for layer in model.model.layers:
            p = packs[layer]
            tensors = [layer.input_layernorm.weight.detach(), p.qkv.packed, p.qkv.bias, p.o.packed, p.o.bias,
                       layer.post_attention_layernorm.weight.detach(), p.gate_up.packed, p.gate_up.bias, p.down.packed,
                       p.down.bias]
            specs.append([empty if t is None else t.contiguous() for t in tensors])
            eps += [layer.input_layernorm.variance_epsilon, layer.post_attention_layernorm.variance_epsilon]
            windows.append(WINDOW_OF[type(layer).__name__](layer) or 0)
        attn = model.model.layers[0].self_attn
        dim, norm = attn.head_dim, model.model.norm
        self.native = kernels.FusedDecoder(specs, eps, windows, attn.q_proj.out_features // dim,
                                           attn.k_proj.out_features // dim, dim, attn.scaling, norm.weight.detach(),
                                           norm.variance_epsilon, head.packed, head.out_features,
                                           empty if head.bias is None else head.bias)
        self.argmax = kernels.argmax_rows
        """torch.argmax's tokens, off OpenMP (see `argmax_rows` in `cpu_kernels.cpp`)."""

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


def _stacked_bias(linears: list[nn.Linear]) -> torch.Tensor | None:
    """The biases of linears computed as one, stacked (zeros for those without); None if none has one."""
    if all(m.bias is None for m in linears):
        return None
    return torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears])


def _stacked(linears: list[nn.Linear]) -> cpu_linear.PanelLinear:
    """One packed linear over several that share an input (their weights stay as they are)."""
    return cpu_linear.PanelLinear([m.weight.detach() for m in linears], _stacked_bias(linears))


class _LayerLinears:
    """A decoder layer's four packed linears: q/k/v and gate/up stacked, o and down."""

    def __init__(self, layer: nn.Module):
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = _stacked([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o = _stacked([attn.o_proj])
        self.gate_up = _stacked([mlp.gate_proj, mlp.up_proj])
        self.down = _stacked([mlp.down_proj])


def _fused_forward(layer: nn.Module, linears: _LayerLinears, kernels):
    attn = layer.self_attn
    qkv, o_proj, gate_up, down = linears.qkv, linears.o, linears.gate_up, linears.down
    dim = attn.head_dim
    heads, kv_heads = attn.q_proj.out_features // dim, attn.k_proj.out_features // dim
    norm_in, norm_post = layer.input_layernorm, layer.post_attention_layernorm
    window = WINDOW_OF[type(layer).__name__](layer)

    def forward(hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                position_embeddings=None, **kwargs):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1]).contiguous()
        t = x.shape[0]
        h, _ = kernels.rms_norm(x, None, norm_in.weight, norm_in.variance_epsilon)
        y = qkv(h)  # [T, (heads + 2 kv_heads) * dim]
        cos, sin = (c if c.is_contiguous() else c.contiguous() for c in position_embeddings)  # [1, T, dim]
        kernels.rotary_(y, cos, sin, heads + kv_heads)
        q = y[:, : heads * dim].view(t, heads, dim).transpose(0, 1)[None]
        k = y[:, heads * dim : (heads + kv_heads) * dim].view(t, kv_heads, dim).transpose(0, 1)[None]
        v = y[:, (heads + kv_heads) * dim :].view(t, kv_heads, dim).transpose(0, 1)[None]
        out, _ = jitney_attention(attn, q, k, v, None, scaling=attn.scaling, sliding_window=window, **kwargs)
        h, x = kernels.rms_norm(o_proj(out.reshape(t, heads * dim)), x, norm_post.weight, norm_post.variance_epsilon)
        x = x + down(kernels.silu_mul(gate_up(h)))
        return x.view(shape)

    return forward
