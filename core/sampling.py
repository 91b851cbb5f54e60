"""Choosing the next token from each sampled row's logits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from jitney.core.processors import Row, shape
from jitney.core.request import SamplingParams

Logprobs = tuple[float, dict[int, float]]
"""A drawn token's log-probability and its row's likeliest tokens with theirs (`SamplingParams.logprobs`)."""


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           argmax: Callable[[torch.Tensor], list[int]] | None = None, rows: list[Row | None] | None = None,
           ) -> tuple[list[int], dict[int, str], dict[int, Logprobs]]:
    """One token per row of `logits` ([N, vocab]): argmax for greedy rows (by `argmax` when given), a seeded
    draw for the others; rows with logits processors run them first (`rows`: each row's, None for plain ones).
    Also returns the rows whose draw failed (row -> why; their token is 0): one request's bad row fails that
    request alone, not the batch; and the logprobs of the rows that ask for them."""
    tokens = argmax(logits) if argmax is not None else logits.argmax(dim=-1).tolist()
    errors: dict[int, str] = {}
    logprobs: dict[int, Logprobs] = {}
    for i, (p, gen) in enumerate(zip(params, generators)):
        state = rows[i] if rows is not None else None
        if p.greedy and state is None and p.logprobs is None:
            continue
        try:
            row = logits[i].float()
            shaped = shape(row, state) if state is not None else row
            if not p.greedy:
                tokens[i] = _draw(shaped, p, gen)
            elif shaped is not row:
                tokens[i] = int(shaped.argmax())
            if p.logprobs is not None:
                logprobs[i] = token_logprobs(row, tokens[i], p.logprobs)
        except Exception as exc:  # e.g. the model's logits for this row hold NaN
            tokens[i] = 0
            errors[i] = f"sampling failed: {type(exc).__name__}: {exc}"
    return tokens, errors, logprobs


def greedy_run(logits: torch.Tensor, best: list[int], guess: list[int], row: Row | None, k: int | None,
               ) -> tuple[list[int], list[Logprobs]]:
    """A greedy sample's tokens from a checking pass (`logits` [len(guess) + 1, vocab]: its token's row, then one a
    guess; `best` their argmax): at each row the token a decode step would choose there, its processors (`row`)
    run over the output followed by the tokens chosen before it, up to and including the first that differs from
    the guess or ends the request on a stop token. Each processor so sees what it sees in decode steps one after
    another. Also each token's logprobs where `k` asks for them."""
    run: list[int] = []
    logprobs: list[Logprobs] = []
    for j in range(len(guess) + 1):
        raw = logits[j].float()
        tok = best[j]
        if row is not None:
            shaped = shape(raw, replace(row, output_ids=row.output_ids + tuple(run)))
            if shaped is not raw:
                tok = int(shaped.argmax())
        run.append(tok)
        if k is not None:
            logprobs.append(token_logprobs(raw, tok, k))
        if j == len(guess) or tok != guess[j] or (row is not None and tok in row.stop_ids):
            break
    return run, logprobs


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> Logprobs:
    """`token`'s log-probability under `logits` ([vocab], fp32) and the `k` likeliest tokens' with theirs."""
    lp = torch.log_softmax(logits, dim=-1)
    if not k:
        return float(lp[token]), {}
    values, ids = torch.topk(lp, k)
    return float(lp[token]), dict(zip(ids.tolist(), values.tolist()))


def _draw(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    logits = logits / p.temperature
    if p.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))  # (the likeliest always stays)
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
