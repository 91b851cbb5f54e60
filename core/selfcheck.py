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
                     kv_cache_dtype: str | None = None) -> list[torch.Tensor]:
    """The model's own logits (its own attention, before the engine binds it) at each probe's last prompt token
    and at its decoded token; `weights` (`EngineConfig.weights`): with each fp32 linear's weight (and for "w8a8"
    its input) rounded as the served path rounds them (`cpu_linear.QuantizedReference`); `kv_cache_dtype`
    (`EngineConfig`'s): with its keys and values rounded as the cache holds them (`RoundedKV`)."""
    rows = []
    rounded = cpu_linear.QuantizedReference(model, weights) if weights else contextlib.nullcontext()
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


def check(engine: Engine, reference: list[torch.Tensor], sequences: list[list[int]]) -> None:
    """Raise `UnfaithfulModel` unless the served logits match the model's own."""
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
    # (int8 activations: the served path and torch's reference may round an input tied between two steps apart)
    half = next(engine.model.parameters()).dtype != torch.float32
    tol = 5e-2 if half or engine.config.weights == "w8a8" else 1e-3
    if not half and engine.cache.keys[0].dtype != torch.float32:
        # a bf16 cache under an fp32 model: the reference rounds its keys and values too, but a key computed by
        # other kernels may round to the next bf16 value. SmolLM2, the largest of the probes' differences over
        # the logits' scale: 1.5e-3 (int8 weights: 3.1e-3); with w8a8, 5.8e-2 (4.2e-2 over an fp32 cache)
        tol = 1e-1 if engine.config.weights == "w8a8" else max(tol, 1e-2)
    if engine.cache.keys[0].dtype == torch.int8:
        # int8 K/V: a code rounds the other way for an input moved by its last bit, and where a row's largest element
        # is an outlier one code is a large step. SmolLM2: served and reference differ by up to 2.0% of the scale,
        # about as much as the reference itself moves when its weights move by 1e-7 (1.3-1.6%); fp32 is 1.5-3.2% away
        tol = 1e-1
    for i, (mine, ref) in enumerate(zip(served, reference)):
        if mine is None:
            continue
        err = (mine.to(ref.device) - ref).abs().max().item()
        scale = max(1.0, ref.abs().max().item())
        if not err <= tol * scale:  # (NaN fails too)
            where = "prefill" if i % 2 == 0 else "decode"
            raise UnfaithfulModel(
                f"jitney cannot run {name} faithfully: its logits through jitney ({where} of a "
                f"{PROMPT_LENGTHS[i // 2]}-token prompt) differ from the model's own by {err:.3g} (scale {scale:.3g}); "
                "an attention feature it uses is probably not implemented")
