"""Incremental detokenization: the text each new token adds, without re-decoding the whole output."""

from __future__ import annotations


class Detokenizer:
    """Decodes a growing list of token ids a few tokens at a time.

    Each call decodes only from a recent offset, so a long output costs O(n) overall; text that ends in an
    incomplete UTF-8 sequence is held back until the next token completes it.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # A fast tokenizer's Rust backend decodes without transformers' per-call argument conversion.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decode = (lambda ids: backend.decode(ids, skip_special_tokens=True)) if backend is not None else (
            lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        self.ids: list[int] = []
        self.prefix = 0  # start of the window decoded for context
        self.read = 0  # tokens whose text has already been returned

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self.tokenizer is None:
            return ""
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""
