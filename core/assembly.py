"""How an engine is put together from its config: the attention backend, the cache, padded steps, the CPU's
packed and fused paths, and the model's stop tokens. Each is decided once, when the engine is built or entered."""

from __future__ import annotations

import importlib.util
import logging
import math

import torch

from jitney.cache.manager import CacheManager, LayerGroup, on_huge_pages
from jitney.cache.sizing import bytes_per_block, check_committable, solve_num_blocks, step_overhead_bytes
from jitney.core.config import EngineConfig
from jitney.core.graphs import CudaGraphCapture, StaticDecoder, eager
from jitney.kernels import cpu_layers, cpu_linear, native
from jitney.kernels.base import KV_CACHE_DTYPES
from jitney.kernels.torch_paged import TorchPagedAttention

log = logging.getLogger("jitney")


def default_attention(param: torch.Tensor) -> str:
    """Triton's kernels on CUDA when Triton is installed; for fp32 on CPU the C++ kernel where it builds;
    the torch reference elsewhere."""
    if param.device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    if param.device.type == "cpu" and param.dtype == torch.float32 and native.available():
        return "cpu"
    return "torch"


def half_fused(cfg: EngineConfig, model) -> bool:
    """Whether a bf16 or fp16 model on CPU runs on the one-call decoder (`cpu_layers.FusedDecoder`) over its own
    weights, packed as they are, with fp32 activations, sums and KV cache: where jitney's C++ kernels build, every
    layer fuses, and the configuration leaves the default CPU paths and attention on (not `batch_invariant`,
    which has a path of its own). Elsewhere such a model runs torch's linears and attention in its dtype."""
    param = next(model.parameters())
    return (param.device.type == "cpu" and param.dtype in (torch.bfloat16, torch.float16) and native.available()
            and cfg.attention_backend in (None, "cpu") and cfg.pack_cpu_weights is not False
            and cfg.fuse_cpu_layers is not False and not cfg.batch_invariant and cfg.weights is None
            and cpu_layers.FusedDecoder.supports(model))


def default_compute(cfg: EngineConfig, model) -> str:
    """`EngineConfig.compute` where it is not given: "bf16" for a bf16 model on the one-call decoder (`half_fused`)
    where the CPU has a matrix unit for it (AMX or AVX512-BF16: about twice fp32's rate on many rows, and rows
    rounded to the model's own precision, as the model computes in its own dtype), else "fp32". An fp16 model keeps
    fp32: its weights would lose three bits in bf16."""
    param = next(model.parameters())
    if param.dtype != torch.bfloat16 or not half_fused(cfg, model):
        return "fp32"
    return "bf16" if native.load().bf16_unit() in ("amx", "avx512-bf16") else "fp32"


def kv_cache_dtype(cfg: EngineConfig, backend, name: str, computed: torch.dtype) -> torch.dtype:
    """The KV cache's dtype: `computed` (what the model's attention computes in), or bf16 or int8 with
    `cfg.kv_cache_dtype`; a `ValueError` where the attention backend cannot read that under `computed` queries."""
    if cfg.kv_cache_dtype is None:
        return computed
    dtype = KV_CACHE_DTYPES[cfg.kv_cache_dtype]
    if dtype != computed and dtype not in getattr(backend, "cache_dtypes", ()):
        raise ValueError(
            f"EngineConfig.kv_cache_dtype={cfg.kv_cache_dtype!r}: the attention backend {name!r} does not read "
            f"{'an' if cfg.kv_cache_dtype == 'int8' else 'a'} {cfg.kv_cache_dtype} cache under "
            f"{str(computed).removeprefix('torch.')} queries (the 'cpu' backend does: an fp32 model on CPU where "
            "jitney's C++ kernels build)")
    return dtype


def build_cache(cfg: EngineConfig, mc, dtype: torch.dtype, device: torch.device, max_context: float,
                eviction, activations: torch.dtype | None = None) -> CacheManager:
    """The paged KV cache of `dtype` for the model config `mc`: `num_blocks` as given, else solved from free
    memory (less a step's overhead, its activations of dtype `activations`, by default the cache's)."""
    heads = mc.num_attention_heads
    kv_heads = getattr(mc, "num_key_value_heads", None) or heads
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // heads
    if dtype == torch.int8:  # each row's scale after its codes (`kernels/base.quantize_kv`)
        head_dim += 4
    layers = mc.num_hidden_layers
    num_blocks = cfg.num_blocks
    per_block = bytes_per_block(layers, cfg.block_size, kv_heads, head_dim, dtype)
    if num_blocks is None:
        overhead = step_overhead_bytes(
            cfg.max_batch_tokens, cfg.max_requests_per_batch, mc.hidden_size,
            getattr(mc, "intermediate_size", 4 * mc.hidden_size), mc.vocab_size, heads, activations or dtype,
        )
        most_useful = None
        if max_context != math.inf:
            most_useful = cfg.max_requests_per_batch * -(-int(max_context) // cfg.block_size)
        cap = cfg.cpu_kv_cache_space if device.type == "cpu" else None
        num_blocks = solve_num_blocks(per_block, overhead, cfg.max_memory_percent, device, most_useful,
                                      None if cap is None else int(cap * 2**30))
    commit = cfg.commit_cache if cfg.commit_cache is not None else cfg.num_blocks is not None
    commit = commit and on_huge_pages(device)  # where the storage can commit its pages at all
    if commit:
        check_committable(per_block, num_blocks, device)
    return CacheManager(layers, kv_heads, head_dim, cfg.block_size, num_blocks, dtype, device, groups=layer_groups(mc),
                        prefix_caching=cfg.allow_block_sharing, eviction=eviction, commit_pages=commit)


def plan_static_steps(cfg: EngineConfig, model, cache: CacheManager, backend, compute_stream,
                      device: torch.device) -> tuple[StaticDecoder | None, bool]:
    """CUDA graphs (auto: on where the device is CUDA and the backend has static steps), padded decode
    steps (with graphs; or, anywhere, when a padding interval is set), and async batching (auto: with
    graphs)."""
    able = device.type == "cuda" and getattr(backend, "static_steps", False)
    if cfg.use_cuda_graph and not able:
        raise ValueError(
            f"use_cuda_graph needs a CUDA device and an attention backend with static steps "
            f"(device {device.type}, backend {type(backend).__name__})"
        )
    graphs = able if cfg.use_cuda_graph is None else cfg.use_cuda_graph
    q = cfg.q_padding_interval_size or (8 if graphs else 0)
    kv = cfg.kv_padding_interval_size or (256 if graphs else 0)
    static = None
    if graphs or q or kv:
        if not getattr(backend, "static_steps", False):
            raise ValueError(f"padded decode steps need an attention backend with static steps, not {type(backend).__name__}")
        capture = CudaGraphCapture(compute_stream) if graphs else eager
        static = StaticDecoder(model, cache, backend, q, kv, capture)
    return static, graphs if cfg.use_async_batching is None else cfg.use_async_batching


def invariant_backend(cfg: EngineConfig, backend, name: str, device: torch.device):
    """The attention backend that serves `cfg`: with `batch_invariant`, the torch backend's rowwise step; a
    `ValueError` where the mode cannot hold (not on CPU, no C++ kernels, linears left to torch, or a backend that
    does not declare `batch_invariant`)."""
    if not cfg.batch_invariant:
        return backend
    why = None
    if device.type != "cpu":
        why = f"it is implemented on CPU only (the model is on {device.type})"
    elif not native.available():
        why = "jitney's C++ kernels do not build here (its linear layers need them)"
    elif cfg.pack_cpu_weights is False:
        why = "pack_cpu_weights=False leaves the linear layers to torch, whose sums depend on the batch"
    elif type(backend) is TorchPagedAttention:
        return TorchPagedAttention(rowwise=True)
    elif not getattr(backend, "batch_invariant", False):
        why = f"the attention backend {name!r} does not declare batch_invariant"
    if why:
        raise ValueError(f"EngineConfig.batch_invariant: {why}")
    return backend


def cpu_paths(cfg: EngineConfig, model) -> tuple[bool, bool]:
    """Whether the linears are packed, and whether Llama-like layers are fused (see `EngineConfig`)."""
    on_cpu = next(model.parameters()).device.type == "cpu"
    pack = cfg.pack_cpu_weights
    if pack is None:
        pack = on_cpu and (native.available() if cfg.batch_invariant or cfg.weights or cfg.compute == "bf16"
                         else cpu_linear.available())
    fuse = cfg.fuse_cpu_layers
    if fuse is None:
        fuse = pack and native.available()
    return pack, fuse


def enter_cpu_paths(cfg: EngineConfig, model, store=None) -> list:
    """Packed linears and fused decoder layers, where configured and possible (see `EngineConfig`), entered, their
    packed copies kept in `store` (`stored.PackedStore`, `EngineConfig.packed_cache`); the caller exits them in reverse
    order. If one fails to enter, those already entered are exited."""
    pack, fuse = cpu_paths(cfg, model)
    fuse = fuse and (next(model.parameters()).dtype == torch.float32 or half_fused(cfg, model))
    quantized, compute = cfg.weights, cfg.compute or default_compute(cfg, model)
    if compute == "bf16":
        kernels = native.load()
        unit, why = kernels.bf16_unit(), kernels.bf16_why_not_amx()
        log.info("linear layers compute in bf16 on %s (%s%s)", unit, BF16_UNITS[unit],
                 f"; not AMX: {why}" if why and unit != "amx-emulated" else "")
    paths: list = []
    try:  # (each exits itself if it fails to enter, its weights put back)
        if fuse:
            paths.append(cpu_layers.FusedLayers(model, quantized=quantized, screen=cfg.lm_head_screen,
                                                compute=compute, release=True, store=store).__enter__())
        if pack:
            skip = paths[0].linears if fuse else frozenset()
            paths.append(cpu_linear.PackedLinears(model, skip=skip, widen=cfg.batch_invariant, quantized=quantized,
                                                  compute=compute, release=True, store=store).__enter__())
    except BaseException:
        for path in reversed(paths):
            path.__exit__(None, None, None)
        raise
    return paths


BF16_UNITS = {"amx": "AMX-BF16 tiles", "avx512-bf16": "AVX512-BF16's vdpbf16ps",
              "portable": "plain C++: this CPU has neither AMX-BF16 nor AVX512-BF16, or its OS does not allow them",
              "amx-emulated": "AMX's code on tiles emulated in plain C++, for tests: slow"}
"""The units bf16 compute runs on (`bf16_unit` in `kernels/cpu/bf16.h`), in words."""


def _why_not_packed(cfg: EngineConfig, model) -> str | None:
    """Why the linears of `model` cannot run on jitney's packed CPU kernels under `cfg`, in words (None: they can)."""
    pack, _ = cpu_paths(cfg, model)
    device = next(model.parameters()).device.type
    if device != "cpu":
        return f"it is implemented on CPU only (the model is on {device})"
    if not native.available():
        return "jitney's C++ kernels do not build here"
    if not pack:
        return "pack_cpu_weights=False leaves the linear layers to torch"
    return None


def check_compute(cfg: EngineConfig, model) -> None:
    """A `ValueError` saying why `EngineConfig.compute="bf16"` cannot serve `model`, if it cannot."""
    if cfg.compute != "bf16":
        return
    why = _why_not_packed(cfg, model)
    if why is None and cfg.weights in ("int8", "w8a8"):
        why = f"it computes over bf16 weights, not weights={cfg.weights!r}"
    if why:
        raise ValueError(f"EngineConfig.compute='bf16': {why}")


def check_weights(cfg: EngineConfig, model) -> None:
    """A `ValueError` saying why `EngineConfig.weights` ("int8", "w8a8" or "bf16") cannot serve `model`, if it cannot."""
    weights = cfg.weights
    if weights is None:
        return
    param = next(model.parameters())
    linears = [(name, m) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.float32]
    narrow = next((f"{name} takes {m.in_features}" for name, m in linears if m.in_features % 32), None)
    why = _why_not_packed(cfg, model)
    if why is None and not linears:
        why = f"the model has no fp32 linear layers (its weights are {param.dtype}: load it in fp32)"
    elif why is None and weights == "w8a8" and narrow:
        why = f"int8 activations go in blocks of 32 inputs, and {narrow} (use weights='int8')"
    if why:
        raise ValueError(f"EngineConfig.weights={weights!r}: {why}")


ATTENTION_PACE = 0.5
"""Prefill attention's multiply-adds a second against the linear layers' (`chunk_context_cost`). SmolLM2, steps of
four decodes and a chunk of a 4,096-token prompt, the 256-token budget: at the multiply-adds' ratio alone the
steps still grew from 135 ms (252 tokens at position 0) to 206 (109 tokens at 3,900); at half the pace they
stayed within 115-143 ms, and the decodes' ITL p99 went from 404 (tokens only) to 137 ms, the whole run as long
(`jitney bench --workload decode-4+long --modes jitney-nospec --chunk-context-cost 0`, and without)."""


def chunk_context_cost(cfg: EngineConfig, model) -> float:
    """`cfg.chunk_context_cost`, or where it is `None` the model's own: the multiply-adds of one query token's
    attention per position it attends to (2 x heads x head_dim a full-attention layer: sliding-window layers,
    whose reach is bounded, are left out where a model has both kinds) over those of one token through the
    linear layers (every weight but the embeddings'; a mixture of experts' experts as many as a token uses),
    over `ATTENTION_PACE`."""
    if cfg.chunk_context_cost is not None:
        return cfg.chunk_context_cost
    mc = model.config.get_text_config()
    heads = mc.num_attention_heads
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // heads
    groups = layer_groups(mc)
    full = sum(len(g.layers) for g in groups if g.window is None) or mc.num_hidden_layers
    skip = {id(m.weight) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None}
    experts = getattr(mc, "num_local_experts", None) or getattr(mc, "num_experts", None)
    used = getattr(mc, "num_experts_per_tok", None)
    linear = 0.0
    for name, p in model.named_parameters():
        if p.dim() >= 2 and id(p) not in skip:
            linear += p.numel() * (used / experts if experts and used and ".experts." in name else 1)
    return 2 * heads * head_dim * full / linear / ATTENTION_PACE if linear else 0.0


def layer_groups(mc) -> list[LayerGroup]:
    """Full-attention layers in one group, sliding-window layers in another (per `layer_types`, else the
    config's `sliding_window` for every layer)."""
    layers = mc.num_hidden_layers
    window = getattr(mc, "sliding_window", None)
    types = getattr(mc, "layer_types", None)
    if not types:
        sliding = window is not None and getattr(mc, "use_sliding_window", True)
        types = ["sliding_attention" if sliding else "full_attention"] * layers
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise NotImplementedError(f"jitney does not support {', '.join(sorted(unknown))} layers yet")
    groups = []
    for kind, name, w in (("full_attention", "full", None), ("sliding_attention", "sliding", window)):
        members = tuple(i for i, t in enumerate(types) if t == kind)
        if members:
            groups.append(LayerGroup(name, members, w))
    return groups


def stop_ids(model, tokenizer) -> tuple[int, ...]:
    """The model's end-of-sequence tokens (generation config, model config, else the tokenizer's)."""
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
