"""Request traces: a JSONL format (one request a line), generators of realistic shapes, and `jitney trace`.

A line::

    {"arrival_s": 0.8, "prompt_tokens": 900, "prefix_group": "tools", "prefix_tokens": 800, "output_tokens": 40}

- ``arrival_s``: seconds from the start of the trace (lines may come in any order).
- ``prompt_ids`` (the token ids), or ``prompt_tokens`` (a count: ids are made up, reproducibly), with
  ``prefix_group`` + ``prefix_tokens``: the first ``prefix_tokens`` ids are the group's shared prefix (a
  system or tool prompt), or ``session``: the prompt extends the session's previous turn (its prompt and its
  output) by ``prompt_tokens`` new ids, or ``prefix_hashes``: the chained hashes of the prompt's first full
  blocks of ``prefix_block`` tokens (what `jitney serve --record-trace` writes unless asked for the ids):
  requests that shared those blocks share them again, and nothing of their text is in the trace — so prefix
  sharing is reproducible without any text.
- ``output_tokens``: tokens to generate (the request ignores end-of-sequence); ``priority`` (default 0);
  ``metadata``: anything, kept as is.
"""

from __future__ import annotations

import argparse
import hashlib
import random
from pathlib import Path
from typing import Any

import msgspec

from jitney.bench.simulate import Arrival


class TraceRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One line of a trace (see the module's docstring)."""

    output_tokens: int
    arrival_s: float = 0.0
    prompt_ids: list[int] | None = None
    prompt_tokens: int | None = None
    prefix_group: str | None = None
    prefix_tokens: int = 0
    session: str | None = None
    prefix_hashes: list[str] | None = None
    prefix_block: int = 16
    priority: int = 0
    metadata: Any = None

    def problem(self) -> str | None:
        if self.output_tokens < 1:
            return "output_tokens must be >= 1"
        if self.arrival_s < 0:
            return "arrival_s must be >= 0"
        if (self.prompt_ids is None) == (self.prompt_tokens is None):
            return "give prompt_ids or prompt_tokens (one of them)"
        if self.prompt_ids is not None and not self.prompt_ids:
            return "prompt_ids is empty"
        if self.prompt_tokens is not None and self.prompt_tokens < 1:
            return "prompt_tokens must be >= 1"
        if self.prefix_group is not None and not 0 < self.prefix_tokens <= (self.prompt_tokens or 0):
            return "prefix_tokens must be between 1 and prompt_tokens with a prefix_group"
        if sum(x is not None for x in (self.session, self.prefix_group, self.prefix_hashes)) > 1:
            return "a request has one of session, prefix_group and prefix_hashes"
        if self.prefix_hashes is not None and not (
                self.prefix_block >= 1 and len(self.prefix_hashes) * self.prefix_block <= (self.prompt_tokens or 0)):
            return "prefix_hashes must cover at most prompt_tokens, in blocks of prefix_block >= 1 tokens"
        return None


def read_trace(path: str | Path) -> list[TraceRequest]:
    """Parse a JSONL trace; a bad line raises `ValueError` naming its number."""
    decoder = msgspec.json.Decoder(TraceRequest)
    out = []
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                request = decoder.decode(line)
            except msgspec.DecodeError as exc:
                raise ValueError(f"{path}, line {number}: {exc}") from None
            problem = request.problem()
            if problem:
                raise ValueError(f"{path}, line {number}: {problem}")
            out.append(request)
    return out


def write_trace(path: str | Path, requests: list[TraceRequest]) -> None:
    encoder = msgspec.json.Encoder()
    with open(path, "wb") as f:
        for request in requests:
            f.write(encoder.encode(request) + b"\n")


def _ids(key: str, count: int, vocab: int) -> list[int]:
    rng = random.Random(hashlib.sha1(key.encode()).digest())
    low = min(100, vocab // 2)
    return [rng.randrange(low, vocab) for _ in range(count)]


def materialize(requests: list[TraceRequest], vocab: int) -> list[Arrival]:
    """Token ids for every request (made-up ids reproducible from the trace alone), in arrival order."""
    out, sessions = [], {}
    for i, r in enumerate(sorted(requests, key=lambda r: r.arrival_s)):
        if r.prompt_ids is not None:
            prompt = [t % vocab for t in r.prompt_ids]
        elif r.session is not None:
            context = sessions.get(r.session, [])
            prompt = context + _ids(f"session {r.session} turn {len(context)}", r.prompt_tokens, vocab)
            # the next turn sees this one's answer (made-up ids: a replay's own answer never matches them either)
            sessions[r.session] = prompt + _ids(f"session {r.session} answer {len(prompt)}", r.output_tokens, vocab)
        elif r.prefix_hashes is not None:
            prompt = [t for h in r.prefix_hashes for t in _ids(f"block {h}", r.prefix_block, vocab)]
            prompt += _ids(f"request {i}", r.prompt_tokens - len(prompt), vocab)
        elif r.prefix_group is not None:
            prompt = _ids(f"group {r.prefix_group}", r.prefix_tokens, vocab) + _ids(f"request {i}", r.prompt_tokens - r.prefix_tokens, vocab)
        else:
            prompt = _ids(f"request {i}", r.prompt_tokens, vocab)
        out.append(Arrival(prompt, r.output_tokens, r.arrival_s, r.priority,
                           r.metadata if isinstance(r.metadata, dict) else None))
    return out


# -- generators -------------------------------------------------------------------------------------------------


def _arrivals(rng: random.Random, count: int, rate: float, shape: float = 1.0) -> list[float]:
    """Arrivals at `rate` a second, gaps drawn from a gamma distribution of this `shape` (1: Poisson; below 1,
    burstier: clumps of arrivals and long lulls, at the same mean rate)."""
    t, out = 0.0, []
    for _ in range(count):
        t += rng.gammavariate(shape, 1 / (shape * rate))
        out.append(t)
    return out


def chat_sessions(count: int, rate: float, seed: int = 0) -> list[TraceRequest]:
    """Multi-turn chats: each session's turns extend its context (2-6 turns, a new question of ~40 tokens)."""
    rng = random.Random(seed)
    out, session = [], 0
    for t in _arrivals(rng, count, rate):
        if not out or rng.random() < 0.3:
            session += 1
        out.append(TraceRequest(arrival_s=round(t, 4), session=f"s{session}", prompt_tokens=rng.randint(16, 80),
                                output_tokens=rng.randint(16, 160)))
    return out


def agentic(count: int, rate: float, seed: int = 0) -> list[TraceRequest]:
    """Agent loops: a long shared tool prompt (one of 3, 1,000-1,500 tokens), a short turn, a short answer."""
    rng = random.Random(seed)
    tools = [rng.randint(1000, 1500) for _ in range(3)]
    out = []
    for t in _arrivals(rng, count, rate):
        k = rng.randrange(3)
        out.append(TraceRequest(arrival_s=round(t, 4), prefix_group=f"tools{k}", prefix_tokens=tools[k],
                                prompt_tokens=tools[k] + rng.randint(8, 64), output_tokens=rng.randint(8, 48)))
    return out


def bursty(count: int, rate: float, seed: int = 0) -> list[TraceRequest]:
    """Independent requests with heavy-tailed lengths (Pareto prompts from 16 tokens, log-normal outputs),
    arriving in bursts: gamma gaps of shape 0.2 (their coefficient of variation is 2.2; Poisson's is 1)."""
    rng = random.Random(seed)
    return [TraceRequest(arrival_s=round(t, 4), prompt_tokens=min(2048, int(16 * rng.paretovariate(1.2))),
                         output_tokens=min(512, max(4, int(rng.lognormvariate(5.0, 0.6)))))
            for t in _arrivals(rng, count, rate, shape=0.2)]


def sharegpt_poisson(count: int, rate: float, seed: int = 0) -> list[TraceRequest]:
    """sharegpt-like lengths (log-normal prompts ~100, outputs ~150 tokens), Poisson arrivals."""
    rng = random.Random(seed)
    return [TraceRequest(arrival_s=round(t, 4), prompt_tokens=min(1024, max(4, int(rng.lognormvariate(4.6, 0.8)))),
                         output_tokens=min(512, max(4, int(rng.lognormvariate(5.0, 0.6)))))
            for t in _arrivals(rng, count, rate)]


def two_tenants(count: int, rate: float, seed: int = 0) -> list[TraceRequest]:
    """Two tenants (`metadata.tenant`): "batch" sends 90% of the requests as an early burst of long jobs (all
    within the first tenth of the trace), "chat" the rest, short, at a steady Poisson `rate`."""
    rng = random.Random(seed)
    chats = max(1, count // 10)
    span = chats / rate
    out = [TraceRequest(arrival_s=round(t, 4), prompt_tokens=rng.randint(20, 80), output_tokens=rng.randint(16, 48),
                        metadata={"tenant": "chat"}) for t in _arrivals(rng, chats, rate)]
    out += [TraceRequest(arrival_s=round(rng.uniform(0, span / 10), 4), prompt_tokens=rng.randint(200, 600),
                         output_tokens=rng.randint(100, 300), metadata={"tenant": "batch"}) for _ in range(count - chats)]
    return sorted(out, key=lambda r: r.arrival_s)


GENERATORS = {"chat-sessions": chat_sessions, "agentic": agentic, "bursty": bursty, "sharegpt": sharegpt_poisson,
              "two-tenants": two_tenants}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kind", choices=sorted(GENERATORS))
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=2.0, help="mean arrivals per second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="the JSONL file to write")


def main(args: argparse.Namespace) -> int:
    if args.requests < 1 or args.rate <= 0:
        raise ValueError("--requests must be >= 1 and --rate > 0")
    requests = GENERATORS[args.kind](args.requests, args.rate, args.seed)
    write_trace(args.out, requests)
    span = max(r.arrival_s for r in requests)
    print(f"{len(requests)} requests over {span:.0f} s written to {args.out}")
    return 0
