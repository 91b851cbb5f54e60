"""What a user submits (`Request`, `SamplingParams`) and what comes back (`Token`, `Completion`)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import msgspec

from jitney.core.grammar import Grammar


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How tokens are chosen for one request. `temperature=0` is greedy."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    """0 (or below `GREEDY_BELOW`, where a distribution scaled by it is one-hot in floating point) is greedy."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 = all)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens, whatever else is in the batch."""
    stop_token_ids: tuple[int, ...] | None = None
    """Tokens that end the request; `None` means the model's end-of-sequence tokens."""
    ignore_eos: bool = False
    """Keep generating through stop tokens until `max_new_tokens`."""
    stop: tuple[str, ...] = ()
    """Strings that end the request once its text contains one; the text returned stops before it."""
    n: int = 1
    """Parallel samples of the prompt; they share its cache blocks (sample i is seeded with seed + i)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the sample has generated so far (OpenAI's definition, -2 to 2)."""
    frequency_penalty: float = 0.0
    """Subtracted once per time a token was generated so far (OpenAI's definition, -2 to 2)."""
    repetition_penalty: float = 1.0
    """transformers' penalty on every token of the prompt and the output: a logit above 0 divided by it, one
    below multiplied (1 = none; 0.01 to 100)."""
    min_p: float = 0.0
    """Drop tokens less likely than `min_p` times the likeliest one (after the temperature; 0 = none)."""
    logit_bias: dict[int, float] | None = None
    """Added to the logits of these token ids before anything else (OpenAI's `logit_bias`, -100 to 100)."""
    min_tokens: int = 0
    """Stop tokens cannot be drawn before this many tokens are generated (stop strings still apply)."""
    processors: tuple[str, ...] = ()
    """Logits processors registered by plugins (`jitney_register_logits_processors`) to run on this request's rows,
    in order, after the built-in ones its params ask for (docs/plugins.md)."""
    extra_args: dict | None = None
    """Anything the request's processors read (`row.params.extra_args`)."""
    grammar: Grammar | None = None
    """Structured output: the output matches this grammar (`Grammar.json(schema)`, `.regex`, `.choice`, `.lark`;
    `jitney.core.grammar`), and the request ends on an end-of-sequence token once it is complete."""
    logprobs: int | None = None
    """Report each token's log-probability and the `logprobs` likeliest alternatives (0 to 20) under the model's
    own distribution (its logits before penalties, bias, temperature or filters); None: none."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1 (got {self.max_new_tokens})")
        if not 0 <= self.temperature < math.inf:  # (NaN fails this too)
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0 (got {self.temperature})")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (got {self.top_k})")
        if any(not s for s in self.stop):
            raise ValueError("SamplingParams.stop strings must not be empty")
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1 (got {self.n})")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1] (got {self.top_p})")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"SamplingParams.{name} must be in [-2, 2] (got {getattr(self, name)})")
        if not 0.01 <= self.repetition_penalty <= 100.0:  # (beyond, a logit divided by it overflows float32)
            raise ValueError(f"SamplingParams.repetition_penalty must be in [0.01, 100] (got {self.repetition_penalty})")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1] (got {self.min_p})")
        if any(not -100.0 <= b <= 100.0 for b in (self.logit_bias or {}).values()):
            raise ValueError("SamplingParams.logit_bias values must be in [-100, 100]")
        if any(t < 0 for t in (self.logit_bias or {})):
            raise ValueError("SamplingParams.logit_bias keys must be token ids >= 0")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"SamplingParams.min_tokens must be in [0, max_new_tokens] (got {self.min_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"SamplingParams.logprobs must be in [0, {MAX_LOGPROBS}] or None (got {self.logprobs})")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


MAX_LOGPROBS = 20
"""The most alternatives a token's logprobs may list (OpenAI's bound)."""

GREEDY_BELOW = 1e-5
"""Temperatures below this sample greedily: logits divided by 1e-40 overflow float32 and the draw would be NaN;
at such temperatures the distribution is the argmax anyway."""


class Priority(enum.IntEnum):
    """Priority classes for `Request.priority` (any int works; lower runs first under `scheduler="priority"`)."""

    INTERACTIVE = 0
    BACKGROUND = 10


@dataclass
class Request:
    """One generation request: a prompt (text or token ids) and its sampling parameters."""

    prompt: str | list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | None = None
    """Your id for the request; `None`: the engine makes one at each submit (`TokenStream.request_id`,
    `Completion.request_id`) and leaves this object as it is, so it can be submitted again."""
    priority: int = 0
    """Priority class: lower runs first where a scheduler honours it (`Priority.INTERACTIVE` = 0)."""
    metadata: dict | None = None
    """Anything the caller wants a scheduler or an observer to see (`seq.request.metadata`), e.g. a tenant for a
    fair-share policy; the server fills it from OpenAI's `user` and `metadata` fields."""


class RequestStatus(enum.Enum):
    """Lifecycle: PENDING → PREFILLING → DECODING → FINISHED, or FAILED / CANCELLED."""

    PENDING = "pending"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def done(self) -> bool:
        return self in _ENDED  # a set built once: looking the members up on the class costs more than the test


_ENDED = frozenset({RequestStatus.FINISHED, RequestStatus.FAILED, RequestStatus.CANCELLED})


@dataclass(frozen=True, slots=True)
class Token:
    """One streamed token: its id, the text it adds to its sample's output, and which sample (0 unless n > 1)."""

    token_id: int
    text: str
    index: int = 0
    finish_reason: str | None = None
    """On a sample's final token, how the sample ended (`Sample.finish_reason`: "length", "stop"...); None on the
    others. A sample cancelled or failed after its last token was streamed has none: the stream ends (or raises
    `RequestError`), and `TokenStream.completion()` says how."""
    logprob: float | None = None
    """With `SamplingParams.logprobs`: the token's log-probability under the model's distribution."""
    top_logprobs: dict[int, float] | None = None
    """With `SamplingParams.logprobs` = k > 0: the k likeliest tokens there and their log-probabilities, likeliest
    first (the drawn token among them only where it is one of them)."""


@dataclass(frozen=True)
class Sample:
    """The output of one of a request's samples."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str
    """"length" | "stop" | "cancelled" | "error"."""
    logprobs: list[tuple[float, dict[int, float]]] | None = None
    """With `SamplingParams.logprobs`: each token's (log-probability, likeliest alternatives), as `Token` has them."""


@dataclass(frozen=True)
class Completion:
    """A finished request; `token_ids`, `text` and `finish_reason` are those of its first sample."""

    request_id: str
    prompt: str | list[int]
    prompt_token_ids: list[int]
    samples: list[Sample]
    error: str | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.samples[0].token_ids

    @property
    def text(self) -> str:
        return self.samples[0].text

    @property
    def finish_reason(self) -> str:
        return self.samples[0].finish_reason


class RequestError(RuntimeError):
    """A request failed inside the engine (the message says why); other requests carry on."""


def cut_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """`text` up to the first stop string, and whether one was found."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)
