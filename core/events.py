"""Lifecycle events: frozen msgspec Structs in one tagged union, published once per step.

Observers receive each step's list through the `jitney_on_events` hook; the structs encode to JSON or
msgpack (`msgspec.json.encode(event)`) for traces, the tag naming the event type.
"""

from __future__ import annotations

from typing import Union

import msgspec


class Event(msgspec.Struct, frozen=True, tag=True, kw_only=True, gc=False):
    """Base of all events; `t` is when it happened, by the engine's clock (`time.perf_counter()`, or a
    simulation's virtual clock). (Numbers and strings only, so never in a reference cycle: not tracked by
    Python's garbage collector, which a step of 256 decodes otherwise gave 256 more objects to count and scan;
    null executor, three alternating pairs: scheduler + cache + bus 0.81 / 0.89 / 1.07 ms against
    0.94 / 1.18 / 1.10.)"""

    t: float
    step: int = 0
    """The step this event belongs to: a step's events carry its number (its `StepCompleted.step`); an event
    between steps (a request queued, or aborted, while no step ran) the number of the next step."""


class RequestQueued(Event, frozen=True):
    request_id: str
    prompt_tokens: int
    max_new_tokens: int


class PrefillStarted(Event, frozen=True):
    request_id: str
    cached_tokens: int = 0
    """Tokens taken from the prefix cache instead of being computed."""


class PrefillChunk(Event, frozen=True):
    """Prompt tokens computed in a step: one per chunk, the prompt's last included (with its `FirstToken`)."""

    request_id: str
    tokens: int
    """Prompt tokens computed in this step."""
    computed: int
    """Tokens in the cache after this step."""
    recompute: bool = False
    """Tokens computed before (a request prefilling its prompt and outputs again after a soft reset)."""


class FirstToken(Event, frozen=True):
    request_id: str
    ttft: float
    """Seconds from queueing to the first token."""


class TokensGenerated(Event, frozen=True):
    request_id: str
    tokens: int
    total: int


class RequestFinished(Event, frozen=True):
    request_id: str
    finish_reason: str
    prompt_tokens: int
    output_tokens: int
    latency: float


class RequestFailed(Event, frozen=True):
    request_id: str
    error: str


class RequestOffloaded(Event, frozen=True):
    """The request's blocks moved to the offload backend to free cache; it resumes later without recomputing."""

    request_id: str
    blocks: int


class RequestResumed(Event, frozen=True):
    """An offloaded request's blocks came back into the cache."""

    request_id: str
    blocks: int


class RequestSoftReset(Event, frozen=True):
    """The request's cache was dropped to free blocks; it re-queues with its outputs appended to its prompt."""

    request_id: str
    tokens: int


class StepCompleted(Event, frozen=True):
    requests: int
    prefill_tokens: int
    """Prompt tokens computed in the step, whatever each chunk's size (a chunk of one token too); they add up to the
    `PrefillChunk` events' tokens."""
    decode_tokens: int
    """The step's other query tokens: one a decoding request (its guesses, in a speculative step, not counted)."""
    forward_s: float
    """Seconds inside the model forward and sampling."""
    step_s: float
    """Seconds for the whole step, scheduling and bookkeeping included."""
    waiting: int
    running: int
    free_blocks: int
    """Blocks that can be allocated (free, or cached and demotable)."""
    total_blocks: int
    prefix_query_tokens: int = 0
    """Tokens of the requests that started this step, looked up in the prefix cache."""
    prefix_hit_tokens: int = 0
    """Of those, tokens found cached (their prefill was skipped)."""
    blocks_demoted: int = 0
    """Cached blocks whose content was dropped this step to make room."""
    cached_blocks: int = 0
    """Of `free_blocks`, those cached: no owner, their content kept for prefix hits until evicted."""
    preemptions: int = 0
    """Requests offloaded or soft reset this step."""
    offloaded: int = 0
    """Requests waiting in the offload backend after this step."""
    ahead: bool = False
    """Async batching: prepared and launched while the step before ran, without asking the scheduler."""
    draft_tokens: int = 0
    """Speculative decoding: tokens the draft proposed this step (`EngineConfig.speculative_tokens`), or the
    requests' own earlier tokens did (`EngineConfig.lookup_tokens`)."""
    accepted_tokens: int = 0
    """Of those, tokens the model agreed with: each one a token more than a decode step gives."""
    batch: tuple[tuple[str, int], ...] = ()
    """(request id, tokens computed) of each request in the step, in the scheduler's order."""


AnyEvent = Union[
    RequestQueued, PrefillStarted, PrefillChunk, FirstToken, TokensGenerated, RequestFinished, RequestFailed,
    RequestOffloaded, RequestResumed, RequestSoftReset, StepCompleted,
]
