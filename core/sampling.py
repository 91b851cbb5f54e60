"""Choosing the next token from each sampled row's logits."""

from __future__ import annotations

from collections.abc import Callable

import torch

from jitney.core.request import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           argmax: Callable[[torch.Tensor], list[int]] | None = None) -> list[int]:
    """One token per row of `logits` ([N, vocab]): argmax for greedy rows (by `argmax` when given), a seeded
    draw for the others."""
    tokens = argmax(logits) if argmax is not None else logits.argmax(dim=-1).tolist()
    for i, (p, gen) in enumerate(zip(params, generators)):
        if not p.greedy:
            tokens[i] = _draw(logits[i].float(), p, gen)
    return tokens


def _draw(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    logits = logits / p.temperature
    if 0 < p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= p.top_p  # keep the token that crosses top_p
        logits = logits.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))
