"""Logits processors, the sixth plugin role: a processor edits one row's logits before its token is chosen.

A processor is a callable ``processor(logits, row) -> logits``: `logits` is the row's fp32 logits ([vocab], not to
be written in place), `row` its `Row` (the request's params, its prompt, the tokens it generated so far, the tokens
that would end it). Plugins register factories through ``jitney_register_logits_processors(register)``:
``register(name, factory)``, where ``factory(engine)`` returns the processor, once per engine (it may read the
engine's `tokenizer`, `vocab_size`, `config`). A request names the ones it wants in
``SamplingParams(processors=(...))`` (their arguments, if any, in ``SamplingParams.extra_args``).

The built-ins below are processors too, registered here by the same hook; each runs by itself on the rows whose
params ask for it, in this order, before the named ones: `logit_bias`, `min_tokens`, `repetition_penalty`,
`penalties` (presence and frequency), `grammar` (structured output: `jitney.core.grammar`). A processor that raises
fails its request alone (docs/reliability.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from jitney.core import grammar
from jitney.core.hooks import hookimpl
from jitney.core.request import SamplingParams

LogitsProcessor = Callable[[torch.Tensor, "Row"], torch.Tensor]


@dataclass(frozen=True, slots=True)
class Row:
    """What a processor reads of the sample whose row it edits, taken when its step is prepared."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: tuple[int, ...]
    stop_ids: frozenset[int]
    processors: tuple[tuple[str, LogitsProcessor], ...] = ()
    """The chain this row runs (`chain`), named."""
    state: dict | None = None
    """The sample's own scratch space, kept from step to step (a stateful processor's, e.g. a grammar's matcher);
    only processors touch it, on the forward thread."""


def logit_bias(logits: torch.Tensor, row: Row) -> torch.Tensor:
    """OpenAI's `logit_bias`: each listed token's bias added to its logit."""
    bias = row.params.logit_bias
    return logits.index_add(0, torch.tensor(list(bias), dtype=torch.long),
                            torch.tensor(list(bias.values()), dtype=logits.dtype))


def min_tokens(logits: torch.Tensor, row: Row) -> torch.Tensor:
    """The stop tokens masked while fewer than `min_tokens` tokens are generated."""
    stops = [t for t in row.stop_ids if t < logits.numel()]
    if len(row.output_ids) >= row.params.min_tokens or not stops:
        return logits
    return logits.index_fill(0, torch.tensor(stops, dtype=torch.long), float("-inf"))


def repetition_penalty(logits: torch.Tensor, row: Row) -> torch.Tensor:
    """transformers' `RepetitionPenaltyLogitsProcessor`, value for value: every token of the prompt and the output
    has its logit divided by the penalty where above 0, multiplied where below."""
    penalty = row.params.repetition_penalty
    seen = torch.tensor([*row.prompt_ids, *row.output_ids], dtype=torch.long).unique()
    seen = seen[seen < logits.numel()]  # (an embedding larger than the head: such tokens cannot be drawn anyway)
    score = logits[seen]
    return logits.index_copy(0, seen, torch.where(score < 0, score * penalty, score / penalty))


def penalties(logits: torch.Tensor, row: Row) -> torch.Tensor:
    """OpenAI's presence and frequency penalties over the output: ``logit - count * frequency - (count > 0) *
    presence``."""
    if not row.output_ids:
        return logits
    p = row.params
    ids, counts = torch.tensor(row.output_ids, dtype=torch.long).unique(return_counts=True)
    keep = ids < logits.numel()
    return logits.index_add(0, ids[keep], -(counts[keep].to(logits.dtype) * p.frequency_penalty + p.presence_penalty))


BUILTIN: dict[str, LogitsProcessor] = {fn.__name__: fn for fn in (logit_bias, min_tokens, repetition_penalty, penalties)}
"""The built-in processors, in the order they run."""

ASKS: dict[str, Callable[[SamplingParams], bool]] = {
    "logit_bias": lambda p: bool(p.logit_bias),
    "min_tokens": lambda p: p.min_tokens > 0,
    "repetition_penalty": lambda p: p.repetition_penalty != 1.0,
    "penalties": lambda p: bool(p.presence_penalty or p.frequency_penalty),
    "grammar": lambda p: p.grammar is not None,
}
"""Whether a request's params ask for each built-in."""


@hookimpl
def jitney_register_logits_processors(register) -> None:
    for name, fn in BUILTIN.items():
        register(name, lambda engine, fn=fn: fn)
    register("grammar", lambda engine: grammar.processor(engine.grammars))  # (stateful: a matcher per sample)


def chain(params: SamplingParams, registered: dict[str, LogitsProcessor]) -> tuple[tuple[str, LogitsProcessor], ...]:
    """The processors a request's rows run: the built-ins its params ask for, then those it names. An unknown
    name, or a built-in named, is a ValueError that lists what is registered."""
    for name in params.processors:
        if name in BUILTIN or name not in registered:
            known = ", ".join(sorted(set(registered) - set(BUILTIN))) or "none"
            why = "runs by itself where the params ask for it" if name in BUILTIN else "is not registered"
            raise ValueError(f"logits processor {name!r} {why}; processors a request may name: {known}")
    return (*((n, registered[n]) for n, asks in ASKS.items() if asks(params)),
            *((n, registered[n]) for n in params.processors))


def shape(logits: torch.Tensor, row: Row) -> torch.Tensor:
    """A row's logits ([vocab], fp32) through its chain; the row itself where the chain is empty."""
    for name, processor in row.processors:
        try:
            out = processor(logits, row)
        except Exception as exc:
            raise RuntimeError(f"logits processor {name!r} failed: {type(exc).__name__}: {exc}") from exc
        if not isinstance(out, torch.Tensor) or out.shape != logits.shape:
            raise RuntimeError(f"logits processor {name!r} returned {type(out).__name__} "
                               f"{tuple(getattr(out, 'shape', ()))}, not a tensor of shape {tuple(logits.shape)}")
        logits = out
    return logits
