"""The attention backend role, and how it plugs into transformers' attention-function registry."""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


def int_tensor(values: list[int], device: torch.device | None = None) -> torch.Tensor:
    """An int64 tensor of a flat list of ints. `torch.tensor` parses a list one element at a time (4,352 ints,
    a step's block tables at 256 requests: 650 µs); the array module packs it in one C loop (88 µs)."""
    t = torch.frombuffer(array("q", values), dtype=torch.int64) if values else torch.empty(0, dtype=torch.int64)
    return t if device is None or device.type == "cpu" else t.to(device)


def int_table(rows: list[list[int]], width: int, pad: int, num_rows: int | None = None,
              device: torch.device | None = None) -> torch.Tensor:
    """[num_rows, width] int64: each of `rows` padded with `pad` to `width`, then rows of `pad` only (block
    tables, one flat list on the way: `torch.tensor` on nested lists is several times slower)."""
    num_rows = len(rows) if num_rows is None else num_rows
    flat: list[int] = []
    for r in rows:
        flat += r
        flat += [pad] * (width - len(r))
    flat += [pad] * (width * (num_rows - len(rows)))
    return int_tensor(flat, device).view(num_rows, width)


ATTN_NAME = "jitney"
STEP_KWARG = "jitney_step"  # the forward keyword that carries a step's metadata down to every layer
FEATURES = {"softcap": "attention logit soft-capping", "sinks": "attention sinks (s_aux)"}
"""The optional features of `StepAttention` (a backend lists those it handles in ``supports``), as errors name them."""


@dataclass
class StepInputs:
    """What every attention backend needs to know about one flat step.

    Requests are ordered decodes first (one query token each), then prefill chunks. Request ``i`` runs
    ``query_lens[i]`` new tokens and has ``context_lens[i]`` tokens in its cache once they are written.
    """

    query_lens: list[int]
    context_lens: list[int]
    num_decodes: int
    positions: torch.Tensor
    """[T] absolute position of each query token."""
    block_tables: list[torch.Tensor]
    """Per layer group, [R, max_blocks] block ids, padded with the padding block."""
    group_of_layer: list[int]
    block_size: int
    padding_slot: int
    keys: list[torch.Tensor]
    """Per layer, the cache's key storage [slots, kv_heads, head_dim]."""
    values: list[torch.Tensor]
    static: bool = False
    """Shapes fixed for a CUDA graph: every row is a decode, lengths and indices live in device tensors that
    are rewritten between replays (`context_tensor`, `write_slots` are given), and `context_lens` holds no
    values. A backend then derives shapes only from tensor shapes and launches no host-to-device copy."""

    @cached_property
    def context_tensor(self) -> torch.Tensor:
        """[R] `context_lens` on the step's device (int64)."""
        return int_tensor(self.context_lens, self.positions.device)

    @cached_property
    def write_slots(self) -> list[torch.Tensor]:
        """Per layer group, [T] the cache slot each query token's key and value go to."""
        qlens = int_tensor(self.query_lens, self.positions.device)
        rows = torch.repeat_interleave(torch.arange(len(self.query_lens), device=qlens.device), qlens)
        blocks = torch.div(self.positions, self.block_size, rounding_mode="floor")
        return [t[rows, blocks] * self.block_size + self.positions % self.block_size for t in self.block_tables]


class StepAttention(Protocol):
    """A backend's state for one step: called once per layer.

    Two attention features beyond plain causal (and sliding-window) attention reach it as keywords, given only
    when a layer uses them (a layer without them gets the plain call):

    - ``softcap`` (float; Gemma2's ``attn_logit_softcapping``): each score, after `scaling` and before the
      causal mask, becomes ``softcap * tanh(score / softcap)``.
    - ``sinks`` ([heads] tensor; GPT-OSS's ``s_aux``): one learned logit per query head that joins each row's
      softmax denominator but carries no value, so a row's weights sum to less than one.

    A step that handles them lists them in ``supports`` (a set of ``"softcap"``, ``"sinks"``). Without the
    attribute it supports neither, and a model that uses one is refused at start-up with the feature named:
    a backend written before these keywords existed never serves tokens computed without them.
    """

    def __call__(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
        sliding_window: int | None, *, softcap: float | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write this step's `key`/`value` ([1, kv_heads, T, D]) into the cache, attend `query` ([1, heads, T, D])
        over each request's context, and return [1, T, heads, D]."""


class AttentionBackend(Protocol):
    """An attention kernel over the paged cache, registered with ``jitney_register_attention_backends``.

    `prepare` runs once per step on the step's metadata (index tensors shared by every layer); what it
    returns is then called once per layer inside the model's forward.

    A backend that sets ``static_steps = True`` also handles `StepInputs.static` steps, which CUDA graphs
    and padded decode steps need (without it, the engine turns CUDA graphs off).

    A backend that sets ``batch_invariant = True`` computes each query row's output from that row's query and
    context alone, summed in an order that the rest of the step does not change: only such a backend serves
    `EngineConfig.batch_invariant`.

    A backend whose ``cache_dtypes`` (a set of torch dtypes) holds ``torch.bfloat16`` reads a bf16 cache under
    queries of the model's own dtype (`EngineConfig.kv_cache_dtype`): `StepInputs.keys` / ``values`` are then bf16,
    and the step writes the new K/V into them rounded. With ``torch.int8``, an int8 cache: its rows ([slots,
    kv_heads, head_dim + 4]) hold codes and a scale (`quantize_kv`), written by `cache_rows`. Without it, such a
    cache is refused at start-up (unless the model computes in bf16 anyway, for bf16).

    A backend that sets ``reads_unwritten_slots = False`` reads no slot of a request's blocks past its
    context: the engine then leaves new blocks as they are, where for others it zeroes them before each step
    (a masked slot weighs nothing only if it holds a finite value).
    """

    def prepare(self, step: StepInputs) -> StepAttention: ...


def jitney_attention(module, query, key, value, attention_mask, scaling=None, sliding_window=None, **kwargs):
    """The function transformers calls for each attention layer once the model uses `ATTN_NAME`."""
    step = kwargs.get(STEP_KWARG)
    if step is None:
        raise RuntimeError(
            "this model's attention is bound to a jitney engine; run it through the engine, "
            "or call model.set_attn_implementation('sdpa') first"
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    if softcap is None and sinks is None:
        return step(module.layer_idx, query, key, value, scaling, sliding_window), None
    missing = [FEATURES[name] for name, used in (("softcap", softcap), ("sinks", sinks))
               if used is not None and name not in getattr(step, "supports", ())]
    if missing:
        raise NotImplementedError(f"its attention backend does not support {' or '.join(missing)}")
    return step(module.layer_idx, query, key, value, scaling, sliding_window, softcap=softcap, sinks=sinks), None


AttentionInterface.register(ATTN_NAME, jitney_attention)


KV_CACHE_DTYPES = {"bf16": torch.bfloat16, "int8": torch.int8}
"""`EngineConfig.kv_cache_dtype`'s names and the dtypes of the caches they give."""

KV8_UNIT = torch.tensor(1 / 127, dtype=torch.float32)


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """Rows of `x` ([..., D]) as an int8 cache stores them (`EngineConfig.kv_cache_dtype="int8"`): [..., D + 4]
    int8, D codes and then the four bytes of the row's fp32 scale; its values are code * scale (`dequantize_kv`).
    scale = max |x| * (1 / 127), code = x * (127 / max |x|) rounded half to even: what the C++ kernels compute (the
    same fp32 operations in the same order), so a row rounds alike on every path. A row with a NaN or an infinity
    gets codes 0 and a NaN scale: every value it gives back is NaN; one whose largest magnitude is below 2^-120
    (where 127 / max |x| would overflow) gets codes 0: values 0."""
    x = x.float()
    finite = torch.isfinite(x).all(-1, keepdim=True)
    top = x.abs().amax(-1, keepdim=True)
    scale = torch.where(finite, top * KV8_UNIT, float("nan"))
    # (a true division: `127 / top` would be 127 times top's reciprocal, rounded twice)
    inv = torch.where(finite & (top >= 2.0**-120), torch.tensor(127.0).div(top), 0.0)
    codes = torch.round(torch.where(finite, x, 0.0) * inv).to(torch.int8)
    return torch.cat([codes, scale.view(torch.int8)], dim=-1)


def dequantize_kv(q: torch.Tensor) -> torch.Tensor:
    """The fp32 values of int8 cache rows ([..., D + 4] -> [..., D])."""
    return q[..., :-4].float() * q[..., -4:].contiguous().view(torch.float32)


def cache_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keys or values ([..., D]) as a cache of `dtype` stores them: int8 rows with their scale, or rounded (to
    nearest even) to a float dtype."""
    return quantize_kv(x) if dtype == torch.int8 else x.to(dtype)


class RoundedKV:
    """While entered, `model`'s attention (its own function: SDPA, eager, ...) reads its keys and values rounded to
    `dtype` and widened back, as a cache of that dtype holds them (`EngineConfig.kv_cache_dtype`; int8: rows
    quantized as `quantize_kv` does): torch's reference for it (the start-up check's, the tests', `jitney
    quality`'s)."""

    def __init__(self, model, dtype: torch.dtype = torch.bfloat16):
        self.model, self.dtype = model, dtype
        self.saved: str | None = None

    def __enter__(self) -> "RoundedKV":
        self.saved = inner = self.model.config._attn_implementation
        name = f"jitney-kv-{str(self.dtype).removeprefix('torch.')}-{inner}"
        if name not in ALL_ATTENTION_FUNCTIONS:
            dtype = self.dtype

            def attend(module, query, key, value, attention_mask, **kwargs):
                own = (sys.modules[type(module).__module__].eager_attention_forward if inner == "eager"
                       else ALL_ATTENTION_FUNCTIONS[inner])
                key, value = (dequantize_kv(quantize_kv(t)).to(t.dtype) if dtype == torch.int8
                              else t.to(dtype).to(t.dtype) for t in (key, value))
                return own(module, query, key, value, attention_mask, **kwargs)

            AttentionInterface.register(name, attend)
            ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
        self.model.set_attn_implementation(name)
        return self

    def __exit__(self, *exc_info) -> None:
        self.model.set_attn_implementation(self.saved)
