"""The start-up check that the engine runs a model faithfully: a few positions through the model's own
attention, then through the path that will serve it (jitney's attention, fused layers, padded steps), compared.
A model jitney cannot run faithfully is refused when the engine is entered, never served wrong tokens."""

from __future__ import annotations

import contextlib
import logging
import random
from typing import TYPE_CHECKING

import torch

from jitney.core.request import Request, SamplingParams
from jitney.core.sequence import Sequence
from jitney.kernels import cpu_linear
from jitney.kernels.base import KV_CACHE_DTYPES, RoundedKV

if TYPE_CHECKING:
    from jitney.core.engine import Engine

log = logging.getLogger("jitney")

PROMPT_LENGTHS = (5, 9, 13)
"""One prefill chunk of each in a step, then one decode each: mixed lengths, past a short sliding window."""


class UnfaithfulModel(NotImplementedError):
    """The engine cannot run this model faithfully; the message names the model class and the reason."""


def probe_tokens(vocab_size: int) -> list[list[int]]:
    """Each probe sequence: its prompt and the one token it decodes."""
    rng = random.Random(0)
    return [[rng.randrange(min(3, vocab_size - 1), vocab_size) for _ in range(n + 1)] for n in PROMPT_LENGTHS]


def reference_logits(model, sequences: list[list[int]], weights: str | None = None,
                     kv_cache_dtype: str | None = None, compute: str | None = None) -> list[torch.Tensor]:
    """The model's own logits (its own attention, before the engine binds it) at each probe's last prompt token
    and at its decoded token; `weights` (`EngineConfig.weights`): with each fp32 linear's weight (and for "w8a8"
    its input) rounded as the served path rounds them (`cpu_linear.QuantizedReference`); `compute="bf16"`
    (`EngineConfig`'s): each fp32 linear but the head with its weight and its input rounded to bf16 (the same);
    `kv_cache_dtype` (`EngineConfig`'s): with its keys and values rounded as the cache holds them (`RoundedKV`)."""
    rows = []
    bf16 = compute == "bf16"
    rounded = (cpu_linear.QuantizedReference(model, weights, compute=compute or "fp32") if weights or bf16
               else contextlib.nullcontext())
    kv = RoundedKV(model, KV_CACHE_DTYPES[kv_cache_dtype]) if kv_cache_dtype else contextlib.nullcontext()
    with rounded, kv, torch.inference_mode():
        for seq in sequences:
            logits = model(input_ids=torch.tensor([seq], device=model.device), use_cache=False).logits[0]
            rows += [logits[-2].float(), logits[-1].float()]
    return rows


def served_logits(engine: Engine, sequences: list[list[int]]) -> tuple[list[torch.Tensor | None], int]:
    """The same rows by the path that serves requests: one step prefilling every prompt, one decoding each
    (None for a probe the cache has no room for). Also returns how many times jitney's attention was called
    (0: the model's layers never reach it)."""
    executor, cache = engine.executor, engine.cache
    seqs = [Sequence(Request(s[:-1], SamplingParams(max_new_tokens=1)), s[:-1], frozenset(), i,
                     request_id=f"jitney-check-{i}") for i, s in enumerate(sequences)]
    fits = [cache.reserve(seq.request_id, len(tokens)) for seq, tokens in zip(seqs, sequences)]
    probes = [(seq, tokens) for seq, tokens, fit in zip(seqs, sequences, fits) if fit]
    calls = [0]
    backend = executor.backend
    prepare = backend.prepare

    def counting(step):
        attend = prepare(step)

        def counted(*args, **features):
            calls[0] += 1
            return attend(*args, **features)

        counted.supports = getattr(attend, "supports", frozenset())  # what jitney_attention asks the step
        return counted

    backend.prepare = counting  # (an instance attribute, removed below)
    try:
        rows: list[list[torch.Tensor]] = [[], []]
        for phase in (0, 1) if probes else ():
            entries = [(seq, seq.remaining) for seq, _ in probes]
            prepared = executor.prepare(entries)
            with torch.inference_mode():
                executor.zero_new_blocks(prepared)
                logits, _ = executor.logits(prepared)
            order = {i: k for k, i in enumerate(prepared.sampled_entries)}
            rows[phase] = [logits[order[i]].float() for i in range(len(probes))]
            for seq, tokens in probes:  # each takes its decoded token, as `_apply` would
                seq.num_computed = seq.num_tokens
                if phase == 0:
                    seq.output_ids.append(tokens[-1])
        served = iter([r for pair in zip(*rows) for r in pair])
        return [r for fit in fits for r in ((next(served), next(served)) if fit else (None, None))], calls[0]
    finally:
        del backend.prepare
        for seq in seqs:
            cache.release(seq.request_id)


def tolerance(engine: Engine) -> float:
    """How far, as a share of the logits' scale, the served rows may lie from the reference of the format they
    compute in. fp32 throughout: 1e-3 (the same sums in another order). Elsewhere a rounding step (to int8 or bf16)
    can send a value the other way than torch's reference does when the two computed it a last bit apart, and the
    step grows through the layers: each bound is at least about twice the largest difference measured for SmolLM2
    over the kernels' instruction-set levels and tunings (docs/reliability.md, `python -m jitney.bench.levels`)."""
    half = next(engine.model.parameters()).dtype != torch.float32
    cache = engine.cache.keys[0].dtype
    # each linear rounds its rows: 0.69-0.77%, over a bf16 cache 0.67-1.3%; on a Zen 4's AVX512-BF16 0.58% / 0.84%
    if engine.config.compute == "bf16" and not half:
        return 2e-2 if cache == torch.float32 else 3e-2
    if engine.config.weights == "w8a8":  # int8 activations: 2.6-5.6% measured; over a bf16 cache 3.2-5.2%
        return 1e-1 if cache == torch.float32 else 1.5e-1
    if cache == torch.int8:  # int8 K/V: 1.0-2.0%
        return 1e-1
    if half:  # a bf16 or fp16 model: its own forward rounds every layer's output, jitney's does not; the gap grows
        return 1e-1  # with depth (Mistral-7B's shape, 32 layers, random bf16 weights, bf16 compute: 5.1%)
    if cache != torch.float32:  # a bf16 cache: a key computed by other kernels may round to the next value; 0.14-0.22%
        return 1e-2
    return 1e-3


def logit_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b|'s largest element over b's scale (its largest magnitude, at least 1)."""
    return (a.to(b.device) - b).abs().max().item() / max(1.0, b.abs().max().item())


def format_of(config, dtype: torch.dtype = torch.float32) -> str | None:
    """The rounding an engine of `config` computes in beyond the precision of a model of `dtype`, in words (None:
    none). bf16 compute counts for an fp32 model only: a bf16 model's rows are rounded to its own precision."""
    parts = [f"{config.weights} weights"] if config.weights else []
    if config.compute == "bf16" and dtype == torch.float32:
        parts.append("bf16 compute")
    if config.kv_cache_dtype:
        parts.append(f"a {config.kv_cache_dtype} KV cache")
    return " and ".join(parts) or None


def check(engine: Engine, reference: list[torch.Tensor], sequences: list[list[int]],
          own: list[torch.Tensor] | None = None) -> None:
    """Raise `UnfaithfulModel` unless the served logits match the reference (the model's own logits, rounded as
    the served format rounds: `reference_logits`). `own`: the model's logits without that rounding, where there
    is a format; a refusal compares the two to name the likely cause."""
    name = type(engine.model).__name__
    try:
        served, calls = served_logits(engine, sequences)
    except NotImplementedError as exc:
        raise UnfaithfulModel(f"jitney cannot run {name}: {exc}") from exc
    except RuntimeError as exc:
        if "bound to a jitney engine" in str(exc):
            raise UnfaithfulModel(f"jitney cannot run {name}: its layers do not pass the step's data down to the "
                                  "attention function (a decoder layer drops **kwargs)") from exc
        raise
    if all(row is None for row in served):  # (a cache of a few blocks: not even the shortest probe fits)
        log.warning("the cache (%d blocks of %d) is too small to check that jitney runs %s faithfully; not checked",
                    engine.cache.num_blocks, engine.cache.block_size, name)
        return
    fused = engine.executor.decoder is not None or engine.executor.static is not None
    if calls == 0 and not fused:
        raise UnfaithfulModel(f"jitney cannot run {name}: its attention never reaches jitney's attention function "
                              "(its modeling code does not use transformers' attention registry)")
    tol = tolerance(engine)
    for i, (mine, ref) in enumerate(zip(served, reference)):
        if mine is None:
            continue
        err = logit_error(mine, ref)
        if not err <= tol:  # (NaN fails too)
            where = "prefill" if i % 2 == 0 else "decode"
            measured = (f"its logits through jitney ({where} of a {PROMPT_LENGTHS[i // 2]}-token prompt) differ from "
                        f"the model's own by {err:.3g} of their scale (bound {tol:.3g})")
            raise UnfaithfulModel(f"jitney cannot run {name} faithfully: {measured}; {_cause(engine, err, i, own, reference)}")


def _cause(engine: Engine, err: float, row: int, own: list[torch.Tensor] | None, reference: list[torch.Tensor]) -> str:
    """The likely cause of a refusal, in words: the served format's rounding where the model's logits move about as
    much under it alone, else what jitney computes differently."""
    dtype = next(engine.model.parameters()).dtype
    fmt = format_of(engine.config, dtype)
    if fmt and own is not None:
        effect = logit_error(reference[row], own[row])  # what the format's rounding alone does to this row
        compared = f"{fmt} alone move them by {effect:.3g} (torch's reference of the format against the model's own)"
        if err <= 3 * effect:
            return f"likely cause: quantization, this model's logits are that sensitive to it: {compared}; serve it without {fmt}"
        return f"not the quantization alone ({compared}): an attention feature it uses is probably not implemented"
    if dtype != torch.float32:
        how = ("rounds each linear's rows to bf16 and sums in fp32" if engine.config.compute == "bf16"
               else "computes in fp32 over them")
        return (f"likely cause: its {str(dtype).removeprefix('torch.')} weights (jitney {how}, the model's own forward "
                "rounds each layer), or an attention feature it uses is not implemented")
    return "an attention feature it uses is probably not implemented"
