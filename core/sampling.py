"""Choosing the next token from each sampled row's logits."""

from __future__ import annotations

from collections.abc import Callable

import torch

from jitney.core.request import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           argmax: Callable[[torch.Tensor], list[int]] | None = None) -> tuple[list[int], dict[int, str]]:
    """One token per row of `logits` ([N, vocab]): argmax for greedy rows (by `argmax` when given), a seeded
    draw for the others. Also returns the rows whose draw failed (row -> why; their token is 0): one
    request's bad row fails that request alone, not the batch."""
    tokens = argmax(logits) if argmax is not None else logits.argmax(dim=-1).tolist()
    errors = {}
    for i, (p, gen) in enumerate(zip(params, generators)):
        if not p.greedy:
            try:
                tokens[i] = _draw(logits[i].float(), p, gen)
            except Exception as exc:  # e.g. the model's logits for this row hold NaN
                tokens[i] = 0
                errors[i] = f"sampling failed: {type(exc).__name__}: {exc}"
    return tokens, errors


def _draw(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    logits = logits / p.temperature
    if 0 < p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= p.top_p  # keep the token that crosses top_p
        drop[0] = False  # and always the likeliest: a top_p that rounds to 0 in float32 would drop every token
        logits = logits.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))
