"""Structured output: a request's tokens held to a grammar (a JSON schema, any JSON object, a regex, a choice of
strings, a Lark grammar) by the `grammar` logits processor, through llguidance.

Each sample has its own matcher, made at its first sampled row and fed the tokens it drew since; each step, the
matcher's mask of the tokens that keep the output in the language sets every other logit to -inf. Grammars are
compiled from their spec once per engine and cached by it (`Grammars.grammar`), on whichever thread asks first —
the server's tokenizing thread, or the forward thread — never on the event loop; the tokenizer's index for the
masks (0.4 s to build for SmolLM2's 49,152 tokens) likewise, once. Once the grammar is complete, only end-of-sequence
tokens remain allowed: the request ends on one ("stop").
"""

from __future__ import annotations

import functools
import json
import threading

import msgspec
import numpy as np
import torch

GRAMMAR_KINDS = ("json", "regex", "choice", "lark")


class Grammar(msgspec.Struct, frozen=True):
    """What a request's output must match (`SamplingParams.grammar`): ``Grammar.json(schema)`` (``schema=None``: any
    JSON object), ``Grammar.regex(pattern)``, ``Grammar.choice(["yes", "no"])``, ``Grammar.lark(text)``."""

    kind: str
    spec: str
    """The schema as JSON text ("" for any object), the pattern, the choices as a JSON list, or the Lark text."""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"Grammar.kind must be one of {', '.join(GRAMMAR_KINDS)} (got {self.kind!r})")

    @classmethod
    def json(cls, schema: dict | str | None = None) -> "Grammar":
        return cls("json", "" if schema is None else schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def regex(cls, pattern: str) -> "Grammar":
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: list[str] | tuple[str, ...]) -> "Grammar":
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("Grammar.choice needs at least one non-empty string")
        return cls("choice", json.dumps(list(choices)))

    @classmethod
    def lark(cls, text: str) -> "Grammar":
        return cls("lark", text)


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise RuntimeError("structured output needs llguidance, a dependency of jitney: pip install llguidance") from None
    return llguidance


class Grammars:
    """One engine's grammar compiler: the tokenizer's index and the compiled grammars, built once and shared by
    every thread that asks."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._index = None
        self._lock = threading.Lock()
        self.grammar = functools.lru_cache(maxsize=256)(self._compile)

    def index(self):
        """llguidance's tokenizer (built at first use, ~1 s)."""
        with self._lock:
            if self._index is None:
                if self.tokenizer is None:
                    raise ValueError("structured output needs the model's tokenizer")
                import llguidance.hf

                self._index = llguidance.hf.from_tokenizer(self.tokenizer, self.vocab_size)
            return self._index

    def _compile(self, grammar: Grammar) -> str:
        """The grammar in llguidance's form, checked against the tokenizer; a ValueError says what is wrong."""
        ll = _llguidance()
        matcher = ll.LLMatcher
        if grammar.kind == "json":
            try:
                schema = json.loads(grammar.spec) if grammar.spec else {"type": "object"}
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not JSON: {exc}") from None
            text = matcher.grammar_from_json_schema(schema, {"whitespace_flexible": False})
        elif grammar.kind == "regex":
            text = matcher.grammar_from_regex(grammar.spec)
        elif grammar.kind == "choice":
            choices = json.loads(grammar.spec)
            text = matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        else:
            text = matcher.grammar_from_lark(grammar.spec)
        error = matcher.validate_grammar(text, self.index())
        if error:
            raise ValueError(f"invalid {grammar.kind} grammar: {error}")
        return text

    def matcher(self, grammar: Grammar):
        return _llguidance().LLMatcher(self.index(), self.grammar(grammar), log_level=0)


UNFOLLOWABLE = "the grammar cannot be followed with this model's tokens"
"""What a request fails with where its grammar needs bytes no sequence of the vocabulary's tokens spells (a regex of
a code point whose first byte no token holds): the matcher's mask then offers a token it refuses (llguidance 1.9).
The grammar is at fault, not the server (`serve.app` answers 400)."""


def processor(grammars: Grammars):
    """The `grammar` logits processor of an engine: each sample's matcher in its row's `state`."""

    def grammar(logits: torch.Tensor, row) -> torch.Tensor:
        state = row.state
        matcher = state.get("matcher")
        if matcher is None:
            matcher = state["matcher"] = grammars.matcher(row.params.grammar)
            state["fed"] = 0
        fed = state["fed"]
        for tok in row.output_ids[fed:]:
            if not matcher.consume_token(tok):  # (a token its own mask allowed: a text the tokens cannot spell)
                raise RuntimeError(f"{UNFOLLOWABLE}: its matcher allowed token {tok}, then refused it: "
                                   f"{matcher.get_error()}")
        state["fed"] = len(row.output_ids)
        if matcher.is_error():
            raise RuntimeError(f"the grammar failed: {matcher.get_error()}")
        # token t is bit t % 32 of 32-bit word t // 32: bit t % 8 of byte t // 8 (little-endian). numpy, not torch:
        # unpacking by shifts and `masked_fill` took ~90 us a row against ~40 us (SmolLM2's 49,152 tokens).
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        n = logits.numel()
        allowed = (bits[:n] if bits.size >= n else np.concatenate([bits, np.zeros(n - bits.size, np.uint8)])).view(bool)
        if logits.device.type == "cpu":
            return torch.from_numpy(np.where(allowed, logits.numpy(), np.float32(-np.inf)))
        return logits.masked_fill(torch.from_numpy(~allowed).to(logits.device), float("-inf"))

    return grammar
