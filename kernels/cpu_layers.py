"""Llama-like decoder layers on CPU in a dozen calls each instead of about sixty.

transformers' decoder layer runs ~15 module calls and ~45 small torch ops per layer; at batch 1 on SmolLM2
those cost about a quarter of a step (~8 of ~32 ms). While `FusedLayers` is entered, each supported layer instead runs:
RMSNorm (C++), one linear over q, k and v stacked, rotary embedding in place (C++), the engine's attention
backend, the output projection, residual add + RMSNorm (C++), one linear over gate and up that computes
act(gate)·up in the same pass (C++; where the MLP's width is not a multiple of 16, stacked and then act(gate)·up in a
pass of its own), the down projection and the residual add. Linears go through `cpu_linear.PanelLinear` (one packed copy
of the stacked weights, C++).

Supported: transformers' Llama, Mistral, Qwen2, Qwen3 (per-head query and key norms, C++), Phi3 (q/k/v and
gate/up already one linear each; rotary over whole heads), Gemma, Gemma2, Gemma3 (norms of 1 + weight, GeLU's
tanh approximation, norms of the attention's and the MLP's outputs, Gemma2's soft-capped attention, Gemma3's
rotary angles per kind of layer), OLMo2 (output norms only, query and key norms across all heads), Granite
(its multipliers) and SmolLM3 (layers without rotary embedding) decoder layers on CPU, fp32, or bf16 / fp16
weights computed in fp32 (only where the whole model fuses: `FusedDecoder`); other layers run unchanged.

Where every decoder layer of a causal LM in `DECODER_MODELS` is fused, steps skip even those calls:
`FusedDecoder` runs all the layers, the final norm and the LM head in one C++ call (the same kernels in the
same order, over the same packed weights), the embedding and rotary angles through the model's own modules.
At batch 1 on SmolLM2 the Python between the layers was ~4 ms of a ~23 ms step; in mixed-64's prefill steps
~0.3 s of 6. `FusedDecoder.speculate` runs speculative decode steps: the same decoder over int8 copies of the
weights proposes tokens, the fp32 one checks them all in one pass.

`FusedLayers(model, quantized="int8")` (`EngineConfig.weights`) packs every one of those linears, the LM head
included, as int8 (`cpu_linear.PanelLinear(quantized=...)`; "w8a8": int8 activations too): the same kernels
and order, a quarter of the weights' bytes. Such a decoder is its own draft. "bf16": the weights rounded to
bfloat16, half their bytes, rows and sums in fp32 (the draft stays int8).
"""

from __future__ import annotations

from collections.abc import Callable

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
             "Qwen3DecoderLayer": _module_window, "Phi3DecoderLayer": _config_window, "GemmaDecoderLayer": _no_window,
             "Gemma2DecoderLayer": _module_window, "Gemma3DecoderLayer": _module_window, "Olmo2DecoderLayer": _no_window,
             "GraniteDecoderLayer": _no_window, "SmolLM3DecoderLayer": _module_window}
HEAD_NORMS = {"Qwen3DecoderLayer", "Gemma3DecoderLayer", "Olmo2DecoderLayer"}
"""Layers that normalise their queries and keys (`q_norm`, `k_norm`) before the rotary embedding: each head
(Qwen3, Gemma3) or all heads at once (OLMo2)."""
STACKED_PROJECTIONS = {"Phi3DecoderLayer"}
"""Layers whose q/k/v and gate/up projections are one linear each already (`qkv_proj`, `gate_up_proj`)."""
OUTPUT_NORMS = {"Gemma2DecoderLayer", "Gemma3DecoderLayer"}
"""Layers that also normalise the attention's and the MLP's outputs before adding them to the residual stream:
`post_attention_layernorm` is then the attention output's norm, `pre_feedforward_layernorm` the MLP input's and
`post_feedforward_layernorm` the MLP output's."""
ONLY_OUTPUT_NORMS = {"Olmo2DecoderLayer"}
"""Layers that normalise the attention's and the MLP's outputs only (`post_attention_layernorm`,
`post_feedforward_layernorm`), their inputs as they are."""
RESIDUAL_SCALED = {"GraniteDecoderLayer"}
"""Layers whose attention and MLP outputs are multiplied by `residual_multiplier` before joining the residual."""
ROTARY_OPTIONAL = {"SmolLM3DecoderLayer"}
"""Layers whose attention turns its queries and keys only where `use_rope` (SmolLM3: not every fourth layer)."""
SOFT_CAPPED = {"Gemma2DecoderLayer"}
"""Layers whose attention soft-caps its scores by `attn_logit_softcapping` (where set)."""
ONE_PLUS_NORMS = {"GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm"}
"""RMSNorms that multiply the normalised row by 1 + weight (computed once, when the layer is packed)."""
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""A layer's weights, all of one of these types: bf16 and fp16 ones are packed as they are
(`cpu_linear.PanelLinear`), and the layer computes in fp32 (`FusedLayers`)."""
Verify = Callable[[torch.Tensor, list[list[int]]], list[list[int]]]
"""Chooses a checking pass's tokens from its logits ([rows, vocab]: each row's token, then one a proposal) and the
proposals (`FusedDecoder.speculate`, `check`)."""

ACTIVATIONS = {"SiLUActivation": "silu", "GELUTanh": "gelu_tanh"}
"""The MLP activations (by class) the fused path computes (`cpu_linear.ACTIVATIONS`)."""


def _groups(layer: nn.Module) -> tuple[list[nn.Linear], list[nn.Linear], list[nn.Linear], list[nn.Linear]]:
    """A supported layer's linears as the fused path computes them, each group as one: q/k/v, o, gate/up, down."""
    attn, mlp = layer.self_attn, layer.mlp
    if type(layer).__name__ in STACKED_PROJECTIONS:
        return [attn.qkv_proj], [attn.o_proj], [mlp.gate_up_proj], [mlp.down_proj]
    return [attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj], [mlp.gate_proj, mlp.up_proj], [mlp.down_proj]


def _norms(layer: nn.Module) -> dict[str, nn.Module | None]:
    """A supported layer's RMSNorms by role: the attention's input, the MLP's input, each query and key head,
    the attention's output and the MLP's output (None: the layer has no such norm)."""
    attn, name = layer.self_attn, type(layer).__name__
    heads = name in HEAD_NORMS
    qk = {"q": attn.q_norm if heads else None, "k": attn.k_norm if heads else None}
    if name in ONLY_OUTPUT_NORMS:
        return {"input": None, "mlp": None, **qk, "attn_out": layer.post_attention_layernorm,
                "mlp_out": layer.post_feedforward_layernorm}
    outputs = name in OUTPUT_NORMS
    return {"input": layer.input_layernorm,
            "mlp": layer.pre_feedforward_layernorm if outputs else layer.post_attention_layernorm, **qk,
            "attn_out": layer.post_attention_layernorm if outputs else None,
            "mlp_out": layer.post_feedforward_layernorm if outputs else None}


def _rms_norm(norm: nn.Module) -> bool:
    """Whether `norm` is an RMSNorm this module computes: Llama's (weight x normalised row, `variance_epsilon`) or
    Gemma's (1 + weight, `eps`), its forward unchanged."""
    if "forward" in vars(norm):
        return False
    return hasattr(norm, "eps") if type(norm).__name__ in ONE_PLUS_NORMS else hasattr(norm, "variance_epsilon")


def _multiplier(norm: nn.Module | None) -> tuple[torch.Tensor | None, float]:
    """An RMSNorm's weight as it multiplies the normalised row (Gemma's: 1 + weight, in fp32 as its forward
    computes it) and its epsilon; (None, 0.0) for no norm."""
    if norm is None:
        return None, 0.0
    if type(norm).__name__ in ONE_PLUS_NORMS:
        return (1.0 + norm.weight.detach().float()).contiguous(), norm.eps
    return norm.weight.detach().float().contiguous(), norm.variance_epsilon  # (an fp32 copy of a bf16 model's)


def _activation(layer: nn.Module) -> str | None:
    """The layer's MLP activation as `cpu_linear.ACTIVATIONS` names it, or None if not one of those."""
    act = getattr(layer.mlp, "act_fn", None) or getattr(layer.mlp, "activation_fn", None)
    return ACTIVATIONS.get(type(act).__name__)


def _residual_scale(layer: nn.Module) -> float:
    """What the layer multiplies its attention's and MLP's outputs by before adding them to the residual stream."""
    return layer.residual_multiplier if type(layer).__name__ in RESIDUAL_SCALED else 1.0


def _rotary(layer: nn.Module) -> bool:
    """Whether the layer turns its queries and keys by the rotary embedding."""
    return layer.self_attn.use_rope if type(layer).__name__ in ROTARY_OPTIONAL else True


def _softcap(layer: nn.Module) -> float | None:
    """The layer's attention soft-cap, or None."""
    return layer.self_attn.attn_logit_softcapping if type(layer).__name__ in SOFT_CAPPED else None


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
    attn = layer.self_attn
    linears = [m for group in _groups(layer) for m in group]
    rope = getattr(attn.config, "rope_parameters", None) or {}
    if type(layer).__name__ == "Gemma3DecoderLayer":  # (one set of parameters per kind of layer)
        rope = rope.get(attn.layer_type) or {}
    roles = _norms(layer)
    norms = [n for n in roles.values() if n is not None]
    if roles["q"] is not None:
        heads, kv_heads = _heads(layer)
        if (roles["q"].weight.numel() not in (attn.head_dim, heads * attn.head_dim)
                or roles["k"].weight.numel() not in (attn.head_dim, kv_heads * attn.head_dim)
                or _multiplier(roles["q"])[1] != _multiplier(roles["k"])[1]):
            return False  # (the kernel takes norms of a head or of all heads, with one epsilon)
    weights = [m.weight for m in linears] + [n.weight for n in norms]
    return (
        all(type(m) is nn.Linear for m in linears)
        and len({w.dtype for w in weights}) == 1 and weights[0].dtype in WEIGHT_DTYPES
        and all(w.device.type == "cpu" for w in weights)
        and _activation(layer) is not None
        and rope.get("partial_rotary_factor", 1.0) == 1.0  # (the rotary kernel turns whole heads)
        and getattr(attn, "is_causal", True)
        and all(_rms_norm(n) for n in norms)
    )


class FusedLayers:
    """While entered, every supported decoder layer of `model` runs fused (see the module's docstring);
    `quantized`: over int8 or bf16 copies of the weights ("int8", "w8a8" or "bf16", `cpu_linear.PanelLinear`);
    `screen`: greedy steps through the LM head's screen where it can (`FusedDecoder.screened`); `compute="bf16"`:
    the layers' linears (not the LM head) compute in bf16 (`cpu_linear.PanelLinear(compute=...)`); `release`: the
    layers' packed copies hold their weights instead of the model where they hold them exactly, each layer's given up
    as soon as it is packed (so that packing never holds two copies of the whole model), put back on exit
    (`cpu_linear.release`, `restore`; a checkpoint's weights mapped from its file kept, paged out, and put back as
    they were: `kept_if_mapped`); the LM head's stays (its screen and the draft read it). `store`
    (`stored.PackedStore`): packed copies (the draft's too) mapped from files an earlier start wrote, else kept there to
    be written."""

    def __init__(self, model: nn.Module, quantized: str | None = None, screen: bool = True, compute: str = "fp32",
                 release: bool = False, store=None):
        self.model = model
        self.store = store
        self.quantized = quantized
        self.compute = compute
        self.screen = screen
        self.release = release
        self.released: list[tuple[list[nn.Linear], cpu_linear.PanelLinear, list[torch.Tensor] | None]] = []
        self.patched: list[nn.Module] = []
        self.linears: set[nn.Linear] = set()
        """The linear layers computed here (`PackedLinears` can skip them)."""
        self.decoder: FusedDecoder | None = None
        """A step in one call, where the whole model is fused."""
        self.tensors: list[torch.Tensor] = []
        """The packed copies it made (`core.memory`; the decoder's screen and draft apart)."""

    def __enter__(self) -> "FusedLayers":
        try:
            return self._enter()
        except BaseException:  # (what it packed and released so far put back)
            self.__exit__(None, None, None)
            raise

    def _enter(self) -> "FusedLayers":
        kernels = native.load()
        whole = FusedDecoder.supports(self.model)  # asked before the layers are patched
        if next(self.model.parameters()).dtype != torch.float32 and not whole:
            return self  # (a half-precision model's fused layers return fp32: only where every layer is one of them)
        packs = {}
        keep = cpu_linear.shared(self.model)
        for layer in self.model.modules():
            if supported(layer):
                packs[layer] = _LayerLinears(layer, self.quantized, self.compute, self.store)
                if self.release:  # (a layer's weights given up: kept where a file's mapping holds them, else freed)
                    given_up = ((linears, packed, cpu_linear.release(linears, packed, keep))
                                for linears, packed in zip(_groups(layer), packs[layer].linears))
                    self.released += cpu_linear.kept_if_mapped([g for g in given_up if g[2]])
                    cpu_linear.trim()
                self.tensors += packs[layer].tensors
                layer.forward = _fused_forward(layer, packs[layer], kernels)
                self.patched.append(layer)
                self.linears.update(m for group in _groups(layer) for m in group)
        if whole:
            head = self.model.lm_head
            # the decoder's and the model's forward share it
            head.forward = packed_head = _stacked([head], self.quantized, store=self.store)
            self.tensors += packed_head.tensors
            self.patched.append(head)
            self.linears.add(head)
            self.decoder = FusedDecoder(self.model, packs, packed_head, kernels, self.quantized, self.screen)
        return self

    def __exit__(self, *exc_info) -> None:
        self.decoder, self.tensors = None, []  # (their references to the packed copies, which `restore` gives up)
        for linears, packed, weights in self.released:
            cpu_linear.restore(linears, packed, weights)
        if self.released:
            cpu_linear.trim()  # (the packed copies' pages the C library kept)
        for module in self.patched:
            del module.forward  # back to the class's forward
        self.patched, self.released, self.linears, self.decoder, self.tensors = [], [], set(), None, []


# Causal LMs whose forward is embed -> rotary angles -> every decoder layer -> final norm -> LM head, nothing else.
# (Gemma's embedding scales its rows by sqrt(hidden) itself; Gemma2's and Gemma3's heads soft-cap the logits
# where `final_logit_softcapping` is set; see also `MULTIPLIED`.)
DECODER_MODELS = {"LlamaForCausalLM": "LlamaModel", "MistralForCausalLM": "MistralModel", "Qwen2ForCausalLM": "Qwen2Model",
                  "Qwen3ForCausalLM": "Qwen3Model", "Phi3ForCausalLM": "Phi3Model", "GemmaForCausalLM": "GemmaModel",
                  "Gemma2ForCausalLM": "Gemma2Model", "Gemma3ForCausalLM": "Gemma3TextModel", "Olmo2ForCausalLM": "Olmo2Model",
                  "GraniteForCausalLM": "GraniteModel", "SmolLM3ForCausalLM": "SmolLM3Model"}
MULTIPLIED = {"GraniteForCausalLM"}
"""Models that multiply the embeddings by `config.embedding_multiplier` and divide the logits by
`config.logits_scaling`."""
ROTARY_PER_LAYER_TYPE = {"Gemma3TextModel"}
"""Models whose rotary embedding gives each kind of layer (`config.layer_types`) angles of its own."""


class FusedDecoder:
    """Steps with every decoder layer, the final norm and the LM head in one C++ call (`kernels/cpu/decoder.h`).
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
            and head.weight.dtype == inner.layers[0].self_attn.o_proj.weight.dtype and head.weight.device.type == "cpu"
            and _rms_norm(inner.norm)
            and "forward" not in vars(inner.embed_tokens) and "forward" not in vars(inner.rotary_emb)
        )

    def __init__(self, model: nn.Module, packs: dict[nn.Module, "_LayerLinears"], head: cpu_linear.PanelLinear, kernels,
                 quantized: str | None = None, screen: bool = True):
        self.model = model
        self.kernels = kernels
        self.packs = packs
        self.head = head
        layers = []
        for layer in model.model.layers:
            p = packs[layer]
            layers.append([p.qkv.packed, p.qkv.bias, p.o.packed, p.o.bias, p.gate_up.packed, p.gate_up.bias, p.down.packed,
                           p.down.bias])
        (gated,) = {packs[layer].gate_up.gated for layer in model.model.layers}  # (one MLP width for every layer)
        (self.residual_scale,) = {_residual_scale(layer) for layer in model.model.layers}
        config, inner = model.config.get_text_config(), model.model
        multiplied = type(model).__name__ in MULTIPLIED
        self.embedding_multiplier = config.embedding_multiplier if multiplied else 1.0
        self.logit_divisor = config.logits_scaling if multiplied else 1.0
        self.rope_types = sorted(set(config.layer_types)) if type(inner).__name__ in ROTARY_PER_LAYER_TYPE else None
        """The kinds of layer whose angles the rotary embedding computes apart (each layer takes its kind's)."""
        self.native = self._native(layers, head.packed, head.bias, gated=gated)
        weight = model.lm_head.weight
        if quantized == "bf16" and weight.dtype == torch.float32:  # (the values its panels hold: +half its fp32 bytes)
            weight = weight.detach().to(torch.bfloat16)
        self.screened = (screen and weight.dtype == head.packed.dtype and head.bias is None  # (its panels as it is)
                         and kernels.has_vnni() and self.logit_divisor == 1.0
                         and not getattr(config, "final_logit_softcapping", None) and weight.shape[1] % 32 == 0
                         and weight.numel() < 2**31  # (the gathers of its fp32 logits take int32 offsets)
                         and bool(torch.isfinite(weight).all()))  # (a NaN weight's logit is every row's argmax)
        """Whether greedy steps take the LM head's screen (`HeadScreen` in `kernels/cpu/head_screen.h`): the same tokens
        without most of the fp32 logits."""
        self.screen_tensors = _screen(weight, head) if self.screened else []
        """What the screen holds (`core.memory`; its first, the head's weights, may be the model's own)."""
        if self.screened:
            self.native.screen(*self.screen_tensors)
        self._draft = self.native if quantized in ("int8", "w8a8") else None
        self.draft_tensors: list[torch.Tensor] = []
        """What the draft holds once packed (`core.memory`; none where it is the decoder itself)."""
        self.argmax = kernels.argmax_rows
        """torch.argmax's tokens, off OpenMP (see `argmax_rows` in `kernels/cpu/layers.h`)."""

    def _native(self, layers: list[list[torch.Tensor | None]], head: torch.Tensor, head_bias: torch.Tensor | None,
                gated: bool = False):
        """The C++ decoder over these packed linears (per layer: q/k/v, o, gate/up and down, each with its bias;
        `gated`: every gate/up from `pack_panels_gated`)."""
        model, inner = self.model, self.model.model
        config = model.config.get_text_config()
        specs, eps, windows = [], [], []
        empty = torch.empty(0)  # no bias, no such norm
        for layer, (qkv, qkv_b, o, o_b, gate_up, gate_up_b, down, down_b) in zip(inner.layers, layers):
            norms = {role: _multiplier(n) for role, n in _norms(layer).items()}
            weight = {role: w for role, (w, _) in norms.items()}
            tensors = [weight["input"], qkv, qkv_b, o, o_b, weight["mlp"], gate_up, gate_up_b, down, down_b,
                       weight["q"], weight["k"], weight["attn_out"], weight["mlp_out"]]
            specs.append([empty if t is None else t.contiguous() for t in tensors])
            eps += [norms[role][1] for role in ("input", "mlp", "q", "attn_out", "mlp_out")]
            windows.append(WINDOW_OF[type(layer).__name__](layer) or 0)
        first = inner.layers[0]
        attn, (norm, norm_eps) = first.self_attn, _multiplier(inner.norm)
        kinds = [self.rope_types.index(t) for t in config.layer_types] if self.rope_types else [0] * len(inner.layers)
        rope_of_layer = [kind if _rotary(layer) else -1 for kind, layer in zip(kinds, inner.layers)]
        scale = getattr(inner.embed_tokens, "embed_scale", None)  # (Gemma's, applied by the module; else Granite's)
        scale = self.embedding_multiplier if scale is None else float(scale.to(inner.embed_tokens.weight.dtype))
        return self.kernels.FusedDecoder(
            specs, eps, windows, *_heads(first), attn.head_dim, attn.scaling, norm, norm_eps, head,
            model.lm_head.out_features, empty if head_bias is None else head_bias, gated=gated,
            act=cpu_linear.ACTIVATIONS[_activation(first)], rope_of_layer=rope_of_layer, softcap=_softcap(first) or 0.0,
            final_softcap=getattr(config, "final_logit_softcapping", None) or 0.0, embed_scale=scale,
            residual_scale=self.residual_scale, logit_divisor=self.logit_divisor)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The model's input embeddings of `input_ids` (Granite's times its multiplier, as its forward does)."""
        x = self.model.model.embed_tokens(input_ids)
        x = x * self.embedding_multiplier if self.embedding_multiplier != 1.0 else x
        return x.float()  # (a half-precision model's embeddings as its forward gives them, then computed in fp32)

    def _angles(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary embedding's cos and sin for `positions` ([1, T]): [sets, T, D] each, one set per kind of layer
        (`rope_types`; else one)."""
        rotary = self.model.model.rotary_emb
        if self.rope_types is None:
            cos, sin = rotary(x, positions)
        else:
            cos, sin = (torch.cat(t) for t in zip(*(rotary(x, positions, kind) for kind in self.rope_types)))
        return cos.contiguous(), sin.contiguous()

    def draft_bytes(self) -> int:
        """What `draft` will hold once packed, from the shapes (before it is: `Engine._plan_speculation` asks
        whether it fits): a byte a weight and a scale an output feature."""
        linears = [m for layer in self.model.model.layers for group in _groups(layer) for m in group]
        return sum(m.out_features * (m.in_features + 4) for m in linears + [self.model.lm_head])

    @property
    def draft(self):
        """The same decoder over int8 copies of the weights (each output feature on its own scale: a quarter of
        the fp32 weights' memory; packed at the first use), which proposes the tokens `speculate` checks. With
        quantized weights, the decoder itself."""
        if self._draft is None:
            layers = []
            for layer in self.model.model.layers:
                packed = []
                for linears, own in zip(_groups(layer), self.packs[layer].linears):
                    packed += [cpu_linear.int8_copy(linears, own), _stacked_bias(linears)]
                layers.append(packed)
            head = self.model.lm_head
            head_packed, head_bias = cpu_linear.int8_copy([head], self.head), _stacked_bias([head])
            self._draft = self._native(layers, head_packed, head_bias)
            self.draft_tensors = [t for t in (*(t for packed in layers for t in packed), head_packed, head_bias)
                                  if t is not None]
        return self._draft

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, step, started, greedy: bool = False) -> torch.Tensor:
        """Logits [rows, vocab] of a decode-only step (`StepInputs` `step`, every row one token), or with
        `greedy` each row's greedy token ([rows] int64: the logits' argmax, through the head's screen where
        `screened`); `started()` is called just before the C++ call (which releases the GIL)."""
        x = self._embed(input_ids)  # [1, rows, hidden]
        cos, sin = self._angles(x, positions[None])
        x = x[0].contiguous()
        started()
        return self.native.forward(x, cos, sin, step.keys, step.values, step.block_tables, step.group_of_layer,
                                   step.context_tensor, step.block_size, greedy)

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, step, keep: list[int], started,
             greedy: bool = False) -> torch.Tensor:
        """Logits [len(keep), vocab] of rows `keep` of any step (prefill chunks too) in one C++ call, or their
        greedy tokens (as `__call__`): the same kernels as the fused layers' Python path, in the same order."""
        x = self._embed(input_ids)
        cos, sin = self._angles(x, positions[None])
        x = x[0].contiguous()
        started()
        return self.native.step(x, cos, sin, step.keys, step.values, step.block_tables, step.group_of_layer,
                                step.context_tensor, step.query_lens, step.num_decodes, keep, step.block_size, greedy)

    def speculate(self, input_ids: torch.Tensor, positions: torch.Tensor, step, k: int, started,
                  verify: Verify | None = None) -> list[list[int]]:
        """The greedy tokens of a decode-only step, one to k + 1 per row (speculative decoding).

        The int8 `draft` proposes k tokens after each row's, one pass at a time (writing its own keys and
        values into the row's next k cache slots); then one pass of the model itself runs each row's token and
        its k proposals as k + 1 rows of consecutive positions over the same block table, overwriting those
        slots. A row's tokens are the model's own up to and including the first that differs from the proposal
        (those after it followed from a wrong token). Each of those passes' rows computes as it would alone
        (every kernel here sums a row's outputs in the same order whatever the number of rows), so the tokens
        are the same as k + 1 decode steps one after another would give. With `verify`, the checking pass's logits
        go to it with the proposals and it chooses the tokens (rows whose logits processors run: the executor's)."""
        inner = self.model.model
        rows, width = input_ids.shape[1], k + 1
        span = (positions[:, None] + torch.arange(width)).reshape(1, -1)  # [1, rows * width]
        cos, sin = self._angles(inner.embed_tokens.weight[:1].float(), span)  # (fp32 angles: fp32 rows)
        sets = cos.shape[0]
        cos, sin = cos.view(sets, rows, width, -1), sin.view(sets, rows, width, -1)
        ctx, tables = step.context_tensor, step.block_tables
        draft = self.draft
        started()
        proposed = draft.propose(inner.embed_tokens.weight.detach(), input_ids[0], cos, sin, step.keys, step.values, tables,
                                 step.group_of_layer, ctx, step.block_size, k)
        ids = torch.cat([input_ids[0][:, None], proposed], 1)  # [rows, width]
        best = self.native.forward(
            self._embed(ids.reshape(-1)), cos.reshape(sets, rows * width, -1), sin.reshape(sets, rows * width, -1), step.keys,
            step.values, [t.repeat_interleave(width, 0) for t in tables], step.group_of_layer,
            (ctx[:, None] + torch.arange(width)).reshape(-1), step.block_size, verify is None,
        )
        proposals = [row[1:] for row in ids.tolist()]
        return _accepted(best.tolist(), proposals) if verify is None else verify(best, proposals)

    def check(self, input_ids: torch.Tensor, positions: torch.Tensor, step, proposals: list[list[int]],
              started, verify: Verify | None = None) -> list[list[int]]:
        """The greedy tokens of a decode-only step whose rows come with guesses at their next tokens (`proposals`,
        a list a row, any of them empty: `core/lookup`), one to len + 1 a row. As `speculate`'s checking pass:
        each row's token and its guesses run as rows of consecutive positions over the row's block table (its
        cache reserved for them), and a row keeps the model's tokens up to and including the first that differs
        from its guess: the tokens decode steps one after another would give. `verify`: as `speculate`'s."""
        widths = torch.tensor([1 + len(p) for p in proposals])
        offsets = torch.arange(int(widths.sum())) - (widths.cumsum(0) - widths).repeat_interleave(widths)
        ids = torch.tensor([t for token, guess in zip(input_ids[0].tolist(), proposals) for t in (token, *guess)])
        x = self._embed(ids[None])
        cos, sin = self._angles(x, (positions.repeat_interleave(widths) + offsets)[None])
        x = x[0].contiguous()
        tables = [t.repeat_interleave(widths, 0) for t in step.block_tables]
        contexts = step.context_tensor.repeat_interleave(widths) + offsets
        started()
        best = self.native.forward(x, cos, sin, step.keys, step.values, tables, step.group_of_layer, contexts,
                                   step.block_size, verify is None)
        return _accepted(best.tolist(), proposals) if verify is None else verify(best, proposals)


def _accepted(best: list[int], proposals: list[list[int]]) -> list[list[int]]:
    """Each row's tokens from a checking pass's greedy tokens `best` (a row's token's and then one a guess of
    `proposals`', row after row): the model's up to and including the first that differs from the guess."""
    runs, start = [], 0
    for guess in proposals:
        run = best[start : start + len(guess) + 1]
        accepted = next((j for j, t in enumerate(guess) if run[j] != t), len(guess))
        runs.append(run[: accepted + 1])
        start += len(guess) + 1
    return runs


def _screen(weight: torch.Tensor, head: cpu_linear.PanelLinear) -> list[torch.Tensor]:
    """`cpu_linear.head_screen(weight)`, its int8 parts mapped from `head`'s store where an earlier start wrote them
    (named from the head's packed copy, which `weight` is the weights of)."""
    store = head.store
    if store is None:
        return list(cpu_linear.head_screen(weight))
    keys = [store.derived(head.key, f"screen {i}") for i in range(1, 6)]
    parts = [store.load(key) for key in keys]
    if any(part is None for part in parts):
        weight, *parts = cpu_linear.head_screen(weight)
        store.pending += zip(keys, parts)
    return [weight.detach().contiguous(), *parts]


def _stacked_bias(linears: list[nn.Linear]) -> torch.Tensor | None:
    """The biases of linears computed as one, stacked (zeros for those without); None if none has one."""
    if all(m.bias is None for m in linears):
        return None
    return torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears]).float()


def _stacked(linears: list[nn.Linear], quantized: str | None = None, compute: str = "fp32",
             store=None) -> cpu_linear.PanelLinear:
    """One packed linear over several that share an input (their weights stay as they are)."""
    return cpu_linear.PanelLinear([m.weight.detach() for m in linears], _stacked_bias(linears), quantized=quantized,
                                  compute=compute, store=store)


class _LayerLinears:
    """A decoder layer's four packed linears: q/k/v stacked, o, gate/up (gated: the activation times up in the
    same pass, where the MLP's width is a multiple of 16 and the weights not int8; else stacked) and down."""

    def __init__(self, layer: nn.Module, quantized: str | None = None, compute: str = "fp32", store=None):
        qkv, o, gate_up, down = _groups(layer)
        self.qkv = _stacked(qkv, quantized, compute, store)
        self.o = _stacked(o, quantized, compute, store)
        self.activation = _activation(layer)
        width = sum(m.out_features for m in gate_up) // 2  # the MLP's
        if width % 16 == 0 and quantized in (None, "bf16"):
            weights = [m.weight.detach() for m in gate_up]
            gate_and_up = weights if len(weights) == 2 else list(weights[0].split(width))  # (one linear: its halves)
            self.gate_up = cpu_linear.PanelLinear(gate_and_up, _stacked_bias(gate_up), gated=True, quantized=quantized,
                                                  activation=self.activation, compute=compute, store=store)
        else:
            self.gate_up = _stacked(gate_up, quantized, compute, store)
        self.down = _stacked(down, quantized, compute, store)

    @property
    def linears(self) -> tuple[cpu_linear.PanelLinear, ...]:
        """Its four packed linears, in `_groups`' order."""
        return self.qkv, self.o, self.gate_up, self.down

    @property
    def tensors(self) -> list[torch.Tensor]:
        """What its four linears hold (`core.memory`)."""
        return [t for linear in self.linears for t in linear.tensors]


def _fused_forward(layer: nn.Module, linears: _LayerLinears, kernels):
    attn = layer.self_attn
    norms = {role: _multiplier(n) for role, n in _norms(layer).items()}
    (q_norm, eps), (k_norm, _) = norms["q"], norms["k"]
    residual_scale, rotary = _residual_scale(layer), _rotary(layer)
    qkv, o_proj, gate_up, down = linears.qkv, linears.o, linears.gate_up, linears.down
    act = cpu_linear.ACTIVATIONS[linears.activation]
    dim = attn.head_dim
    heads, kv_heads = _heads(layer)
    window = WINDOW_OF[type(layer).__name__](layer)
    cap = _softcap(layer)
    softcap = {} if cap is None else {"softcap": cap}

    def forward(hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                position_embeddings=None, **kwargs):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1]).float().contiguous()  # (a bf16 model's layers compute in fp32)
        t = x.shape[0]
        h = x if norms["input"][0] is None else kernels.rms_norm(x, None, *norms["input"])[0]
        y = qkv(h)  # [T, (heads + 2 kv_heads) * dim]
        if q_norm is not None:
            kernels.head_norm_(y, heads * dim, kv_heads * dim, q_norm, k_norm, eps)
        if rotary:
            cos, sin = (c if c.is_contiguous() else c.contiguous() for c in position_embeddings)  # [1, T, dim]
            kernels.rotary_(y, cos, sin, heads + kv_heads)
        q = y[:, : heads * dim].view(t, heads, dim).transpose(0, 1)[None]
        k = y[:, heads * dim : (heads + kv_heads) * dim].view(t, kv_heads, dim).transpose(0, 1)[None]
        v = y[:, (heads + kv_heads) * dim :].view(t, kv_heads, dim).transpose(0, 1)[None]
        out, _ = jitney_attention(attn, q, k, v, None, scaling=attn.scaling, sliding_window=window, **softcap, **kwargs)
        a = o_proj(out.reshape(t, heads * dim))
        if norms["attn_out"][0] is not None:
            a, _ = kernels.rms_norm(a, None, *norms["attn_out"])
        if residual_scale != 1.0:
            a = a * residual_scale
        if norms["mlp"][0] is None:
            h = x = x + a
        else:
            h, x = kernels.rms_norm(a, x, *norms["mlp"])
        m = down(gate_up(h) if gate_up.gated else kernels.gated_act(gate_up(h), act))
        if norms["mlp_out"][0] is not None:
            m, _ = kernels.rms_norm(m, None, *norms["mlp_out"])
        if residual_scale != 1.0:
            m = m * residual_scale
        return (x + m).view(shape)

    return forward
