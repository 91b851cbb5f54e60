"""Prompt-lookup proposals: speculative tokens read from a request's own tokens, at no model cost.

Where a request's last few tokens occurred before in its prompt or output, the tokens that followed them there
are a guess at what comes next: text that quotes its prompt (an edit, a summary, code) or repeats itself. The
model checks the guesses in the pass that computes the request's next token (`FusedDecoder.check`) and keeps
them up to the first it disagrees with, so a request's tokens are the same as without; a wrong guess costs
only its row in that pass. `EngineConfig.lookup_tokens` turns it on.
"""

from __future__ import annotations

from jitney.core.sequence import Sequence, greedy_decodes

LOOKUP_NGRAMS = (3, 2)
"""The lengths of the tail looked up, longest first. On mixed-64's greedy outputs (a proposal of up to four
tokens each step, counted offline from the outputs): the last 3 tokens, else 2, gave 2.32 tokens a step, 79% of
proposed tokens right; 3 alone 2.15 and 77%; 3, 2, 1 2.50 but 75%; 2 alone 2.25 and 74%."""

# A wrong guess costs a row of the checking pass; in a step of many rows, bound by its multiply-adds, a row costs
# more than a right guess saves (SmolLM2, mixed-64's steps of 17-48 requests: ~0.8 ms a row against ~1.1 ms a
# token without guesses). So after a guess a request guesses at most one token more than it had right: on
# mixed-64's outputs (counted as above) that wastes 560 rows instead of 1,197 for 4,394 right instead of 4,493.


class NgramIndex:
    """Where each short run of a sequence's tokens occurred last: `LOOKUP_NGRAMS`-long runs mapped to the
    position after their latest occurrence, brought up to date with the tokens added since (the tokens of a
    sequence only grow, across soft resets too)."""

    __slots__ = ("latest", "indexed", "reach")

    def __init__(self) -> None:
        self.latest: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # runs ending before this position are in `latest`
        self.reach: int | None = None  # the most tokens the next guess may have: one more than the last had right

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of `seq`'s last tokens (the longest of
        `LOOKUP_NGRAMS` that occurred before), repeated with the period of that occurrence where they reach the
        end; none where none did."""
        total = seq.num_tokens
        shortest = LOOKUP_NGRAMS[-1]
        k = k if self.reach is None else min(k, self.reach)
        if total <= shortest or k <= 0:
            return []
        longest = LOOKUP_NGRAMS[0]
        start = max(0, self.indexed - longest)
        new = seq.tokens(start, total)  # every run ending in [indexed, total) lies within these tokens
        latest = self.latest
        for end in range(max(self.indexed, shortest), total):  # a run ending at `end` (exclusive), followed by a token
            for n in LOOKUP_NGRAMS:
                if end >= n:
                    latest[tuple(new[end - n - start:end - start])] = end
        self.indexed = total
        for n in LOOKUP_NGRAMS:
            at = latest.get(tuple(new[total - n - start:]))
            if at is not None:
                # tokens that repeat with a short period (total - at) are guessed to go on repeating: on mixed-64,
                # 148 -> 135 steps, 4,533 -> 5,144 tokens guessed, 91% -> 92% right
                guess = seq.tokens(at, min(at + k, total))
                period = total - at
                while len(guess) < k:
                    guess.append(guess[len(guess) - period])
                return guess
        return []


def index_of(seq: Sequence) -> NgramIndex:
    """The sequence's index, made at its first use."""
    if seq.ngrams is None:
        seq.ngrams = NgramIndex()
    return seq.ngrams


def guesses(entries: list[tuple[Sequence, int]], k: int, max_tokens: int, cache) -> list[list[int]] | None:
    """Guesses of up to `k` tokens for each request of a step (`NgramIndex`), their cache reserved (`cache`: the
    engine's `CacheManager`); None for a plain step. Only where every entry decodes one greedy sample; a request's
    guesses stop before its last token, and all rows with their guesses stay within `max_tokens`. A request whose
    guesses find no room in the cache takes none."""
    if not greedy_decodes(entries):
        return None
    budget, out = max_tokens - len(entries), []
    for seq, _ in entries:
        take = min(k, seq.max_new_tokens - len(seq.output_ids) - 1, budget)
        guess = index_of(seq).propose(seq, take) if take > 0 else []
        if guess and not cache.reserve(seq.request_id, seq.num_tokens + len(guess)):
            guess = []
        budget -= len(guess)
        out.append(guess)
    return out if any(out) else None


def learn(entries: list[tuple[Sequence, int]], guessed: list[list[int]], runs: list[list[int] | None]) -> None:
    """After a step with `guesses`' `guessed`: each request that guessed may guess one token more next time than
    it had right (a run holds the right guesses and then the model's own token)."""
    for (seq, _), guess, run in zip(entries, guessed, runs):
        if guess and run:
            index_of(seq).reach = len(run)
